"""``python -m lit_grpo.cli``: the ``lit-grpo`` command run as a module (torchrun's ``-m``, a console script's
stand-in)."""

from lit_grpo.cli import main

if __name__ == "__main__":  # importing it (a walk over the package's modules) runs nothing
    main()
