"""What both halves run on: model loading (``models``), memory measurement (``memory``), processes
(``distributed``), checkpoint files and stopping (``checkpoints``, ``stop_signal``), argument checks
(``validation``) and byte formatting (``sizes``)."""
