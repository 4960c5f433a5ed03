"""The lab: real KV activations of a real model, a quantized cache inside transformers,
recipes built from the SPEC 5 knobs, error metrics, and the report.

Modules (import what you need; torch/transformers are only imported where used)::

    kvlab.lab.model     load_model()           SmolLM2-135M from the shipped GGUF, or any HF causal LM
    kvlab.lab.text      default_text(), token_windows()   CPython's pydoc topics, deterministic windows
    kvlab.lab.capture   capture_kv()           per-layer K/V (post-RoPE), pre-RoPE keys, queries
    kvlab.lab.recipes   QuantSpec, Recipe, FORMAT_RECIPES, get_recipe()
    kvlab.lab.hf_cache  KVLabCache             transformers Cache storing K/V in a kvlab format or recipe
    kvlab.lab.metrics   tensor and attention error metrics, KL / perplexity
    kvlab.lab.study     sweeps that return tidy tables (lists of dicts), markdown_table()
    kvlab.lab.report    main(args)             ``python -m kvlab report``
"""
