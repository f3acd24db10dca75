"""The training application behind ``examples/train.py`` and ``ds-ulysses export|eval``: corpus,
model recipe, progress line, checkpoints, export to a plain HF directory, evaluation by position.
Not part of the library API; it uses the library like any user would."""
