"""`python -m asyncrl.sft`: Stage 2, verifier SFT (asyncrl/verifier_training/sft.py)."""

import sys

from asyncrl.verifier_training.sft import main

if __name__ == "__main__":
    sys.exit(main())
