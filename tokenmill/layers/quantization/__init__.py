"""Quantized linears: each `Linear` owns a `LinearMethod` (base.py) that creates its parameters,
loads and shards the checkpoint's tensors (loading.py), processes them after loading and applies
the layer. A format is a method here plus its entry in `tokenmill.quant_config`; model modules
do not change (methods.attach_linear_methods swaps them in after the model is built)."""
