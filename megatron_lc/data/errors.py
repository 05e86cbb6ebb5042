class DataError(ValueError):
    """Missing, truncated or inconsistent data/tokenizer files; the message says which file and what is wrong."""
