"""Modeling code that `dflash export` copies next to the weights (transformers `trust_remote_code`).

Nothing here is imported by the trainer; `modeling_dflash.py` must stay self-contained (torch + transformers).
"""
