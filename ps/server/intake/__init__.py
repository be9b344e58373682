"""Pushes in: the intake component (intake.py: admit a header, take the pieces, hand the
whole push to the update rule), the checks of a push's header, pieces and verdict and the
in-flight push they fill (pieces.py), push pacing (pacing.py), and a worker's newer push
superseding its stalled one across doors (takeover.py)."""
