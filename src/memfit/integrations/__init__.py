"""memfit where users already train: their own loop (``memfit.apply``), Hugging Face's Trainer
and Lightning (their modules import those libraries only when used)."""
