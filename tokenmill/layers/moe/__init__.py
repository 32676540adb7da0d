"""Mixture-of-experts: routing (`routing`), the experts on CPU (`torch_experts`: tokens sorted by
expert, only the experts that received tokens run) and on CUDA (`fused_moe`: one Triton grouped
GEMM launch for gate/up with the activation fused, one for down with the routing weight fused,
over tokens sorted and padded per expert on the device), and the layer the families use
(`layer.SparseMoE`: router, experts, shared expert, one TP all-reduce).
"""
