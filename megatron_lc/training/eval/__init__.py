"""Evaluation with the training layouts: validation during training (``validation.py``: the valid split's loss, as
training reads it), loss by position bucket (``by_position.py``) and passkey retrieval (``passkey.py``), the last two
run by ``tools/eval_long.py``. Modules are imported by path."""
