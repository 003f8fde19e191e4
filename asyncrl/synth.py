"""`python -m asyncrl.synth`: Stage 1, verifier data synthesis (asyncrl/verifier_training/synth.py)."""

import sys

from asyncrl.verifier_training.synth import main

if __name__ == "__main__":
    sys.exit(main())
