"""Building blocks shared by the model families (norms, rotary, attention and the DSA indexer,
MLPs, the MoE layer, and for hybrid families KDA linear attention and mHC hyper-connections).

A block takes plain sizes (or the `ModelSpec` it reads) and imports no family package."""
