"""What both halves run on: model loading (``models``), the output head in float32 (``head_precision``), memory
measurement (``memory``), processes
(``distributed``), checkpoint files and stopping (``checkpoints``, ``stop_signal``), argument checks
(``validation``), byte formatting (``sizes``) and whether torch's threads wait for busy cores (``threads``)."""
