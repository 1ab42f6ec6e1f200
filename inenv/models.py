"""Model shapes: what sets the size and count of one forward pass's tensor-parallel allreduces, and the width of
the row-parallel matmul before each of them.

Under tensor parallelism every decoder layer ends two row-parallel blocks, attention output (``o_proj``) and MLP
or MoE output (``down_proj``), with an allreduce of ``tokens x hidden`` elements, so ``allreduces_per_layer`` is
2 unless a model says otherwise. ``attn_out`` is the input width of ``o_proj`` (attention heads x value head
size) and ``mlp_out`` the input width of ``down_proj`` that one token uses: the intermediate size of a dense
MLP, or for a mixture of experts the routed experts each token picks times their intermediate size, plus the
shared experts'. Each rank multiplies ``tokens x width / tp`` by ``width / tp x hidden``. The values are those
of each model's published config.json; ``SOURCES`` says, per model, its label, the config and where the values
were read for this file.

Read by the host (``checks advise --model``: the estimate) and by the ``step`` probe inside a cell (the
measured step), so it is standard library data only.
"""

from __future__ import annotations

DEFAULT = "deepseek-v3"

# Bytes per element of the dtypes a model may be given in hidden=..,layers=..,dtype=..
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

SHAPES: dict[str, dict[str, object]] = {
    "deepseek-v3": {
        "hidden": 7168,
        "layers": 61,
        "dtype": "bf16",
        "allreduces_per_layer": 2,
        "attn_out": 16384,  # 128 heads x v_head_dim 128
        "mlp_out": 18432,  # 8 routed + 1 shared expert x moe_intermediate_size 2048 (dense layers: 18432 too)
    },
    "kimi-k2": {
        "hidden": 7168,
        "layers": 61,
        "dtype": "bf16",
        "allreduces_per_layer": 2,
        "attn_out": 8192,  # 64 heads x v_head_dim 128
        "mlp_out": 18432,  # 8 routed + 1 shared expert x 2048
    },
    "llama-3.1-70b": {
        "hidden": 8192,
        "layers": 80,
        "dtype": "bf16",
        "allreduces_per_layer": 2,
        "attn_out": 8192,  # 64 heads x head size 128
        "mlp_out": 28672,
    },
    "qwen3-coder-480b-a35b": {
        "hidden": 6144,
        "layers": 62,
        "dtype": "bf16",
        "allreduces_per_layer": 2,
        "attn_out": 12288,  # 96 heads x head_dim 128
        "mlp_out": 20480,  # 8 routed experts x moe_intermediate_size 2560, no shared expert
    },
    "qwen3-235b-a22b": {
        "hidden": 4096,
        "layers": 94,
        "dtype": "bf16",
        "allreduces_per_layer": 2,
        "attn_out": 8192,  # 64 heads x head_dim 128
        "mlp_out": 12288,  # 8 routed experts x moe_intermediate_size 1536, no shared expert
    },
    "qwen3-32b": {
        "hidden": 5120,
        "layers": 64,
        "dtype": "bf16",
        "allreduces_per_layer": 2,
        "attn_out": 8192,  # 64 heads x head_dim 128
        "mlp_out": 25600,
    },
}


# --- declared fields: where each shape's numbers come from, for the people who read them. Left out of the probe
# hash (inenv.probe.DECLARED_MARK): a reworded source changes no step the probe measures.
SOURCES = {
    "deepseek-v3": {
        "label": "DeepSeek-V3 / R1 class",
        "config": "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (hidden_size 7168, "
        "num_hidden_layers 61, num_attention_heads 128, v_head_dim 128, num_experts_per_tok 8, n_shared_experts 1, "
        "moe_intermediate_size 2048, intermediate_size 18432)",
        "checked": "huggingface.co is not reachable from the machine that wrote this file: checked against "
        "transformers 5.24.0 DeepseekV3Config, whose defaults are the released model's. The MTP layer "
        "(num_nextn_predict_layers 1) is not counted",
    },
    "kimi-k2": {
        "label": "Kimi-K2 class (DeepSeek-V3 architecture)",
        "config": "https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json (hidden_size 7168, "
        "num_hidden_layers 61, num_attention_heads 64, v_head_dim 128, num_experts_per_tok 8, n_shared_experts 1, "
        "moe_intermediate_size 2048)",
        "checked": "huggingface.co is not reachable from the machine that wrote this file: checked against "
        "Moonshot's deployment guide (Kimi-K2 reuses the DeepseekV3 architecture under model_type kimi_k2) and "
        "third-party copies of the config",
    },
    "llama-3.1-70b": {
        "label": "Llama-3.1-70B class",
        "config": "https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json (hidden_size "
        "8192, num_hidden_layers 80, num_attention_heads 64, intermediate_size 28672)",
        "checked": "checked against Meta's own meta-llama/llama-models, models/sku_list.py, Llama 3.1 70b: dim "
        "8192, n_layers 80, n_heads 64; intermediate_size as the published config gives it",
    },
    "qwen3-coder-480b-a35b": {
        "label": "Qwen3-Coder-480B-A35B class",
        "config": "https://huggingface.co/Qwen/Qwen3-Coder-480B-A35B-Instruct/blob/main/config.json (hidden_size "
        "6144, num_hidden_layers 62, num_attention_heads 96, head_dim 128, num_experts_per_tok 8, "
        "moe_intermediate_size 2560)",
        "checked": "huggingface.co is not reachable from the machine that wrote this file: checked against "
        "third-party copies of the config (a training framework's model arguments: 62 layers, hidden 6144, 96 "
        "heads of 128; a deployment note: 160 experts, top 8, moe_intermediate_size 2560)",
    },
    "qwen3-235b-a22b": {
        "label": "Qwen3 MoE class (Qwen3-235B-A22B)",
        "config": "https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json (hidden_size 4096, "
        "num_hidden_layers 94, num_attention_heads 64, head_dim 128, num_experts_per_tok 8, "
        "moe_intermediate_size 1536)",
        "checked": "huggingface.co is not reachable from the machine that wrote this file: checked against the "
        "Qwen3 technical report (table 2: 94 layers, 64 query heads, 128 experts, 8 active) and third-party "
        "copies of the config (hidden 4096, head size 128, expert width 1536)",
    },
    "qwen3-32b": {
        "label": "Qwen3-32B class (dense)",
        "config": "https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json (hidden_size 5120, "
        "num_hidden_layers 64, num_attention_heads 64, head_dim 128, intermediate_size 25600)",
        "checked": "huggingface.co is not reachable from the machine that wrote this file: checked against the "
        "Qwen3 technical report (Qwen3-32B: 64 layers, 64 query heads); the widths (hidden 5120, head size 128, "
        "intermediate 25600) are the published config's, not re-read from the file here",
    },
}
