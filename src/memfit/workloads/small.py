"""Small configs of the built-in Hugging Face workloads: every code path of the full models at a
fraction of their size (2 layers, width 128, a 1000-token vocabulary), so that a real step takes
about a second on 2 CPU cores. The test suite, the accuracy table (``bench/accuracy.py``) and the
prediction grid (``bench/prediction_grid.py``) run them; so can anyone trying memfit on a laptop::

    memfit profile "$(python -c 'from memfit.workloads.small import SMALL_HF; print(SMALL_HF["llama"])')"
"""

SMALL_HF = {
    "gpt2": "gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=1000,n_positions=256",
    "llama": "llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,"
             "num_key_value_heads=2,vocab_size=1000,max_position_embeddings=256",
    "bert": "bert:num_hidden_layers=2,hidden_size=128,num_attention_heads=4,intermediate_size=256,"
            "vocab_size=1000,max_position_embeddings=128",
    "t5": "t5:num_layers=2,d_model=128,d_ff=256,num_heads=4,d_kv=32,vocab_size=1000",
    "vit": "vit:num_hidden_layers=2,hidden_size=128,num_attention_heads=4,intermediate_size=256,image_size=64",
}
SMALL_SEQ = {"llama": 128, "t5": 128}
"""Sequence lengths where the built-in's default is long for a CPU step (others: the default)."""
