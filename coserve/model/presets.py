"""Model size presets for :func:`coserve.model.create.create_model`."""

from __future__ import annotations

from dataclasses import dataclass

#: Architectures ``create_model`` can write, each an HF ``model_type``.
ARCHS: tuple[str, ...] = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3", "granite", "smollm3",
                          "olmo2", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "seed_oss", "olmo3", "glm4_moe",
                          "gpt_oss")
#: The mixtures of experts among them: each layer's MLP is ``NUM_EXPERTS`` experts, ``EXPERTS_PER_TOKEN`` a token
#: (Mixtral 8x7B: 8 and 2; Qwen3-30B-A3B: 128 and 8; OLMoE-1B-7B: 64 and 8), each as wide as the preset's MLP
#: (Qwen3-MoE's and OLMoE's: half as wide, their moe_intermediate_size or intermediate_size)
MOE_ARCHS: tuple[str, ...] = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe", "gpt_oss")
NUM_EXPERTS, EXPERTS_PER_TOKEN = 4, 2
#: GLM-4.5's (``glm4_moe``): twice as many experts in two groups, a token's from the better group; its first layer
#: dense, as GLM-4.5-Air's (GLM-4.5: 160 experts, 8 a token, the first three layers dense)
GLM_EXPERTS, GLM_GROUPS, GLM_DENSE_LAYERS = 2 * NUM_EXPERTS, 2, 1
#: Weight dtypes ``create_model`` can write.
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelPreset:
    """The shape of a decoder-only transformer (shared by every architecture in :data:`ARCHS`)."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        """Per-head width: ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    def expert_size(self, arch: str) -> int:
        """An expert's MLP width as ``create-model`` writes ``arch`` (a mixture of experts)."""
        return self.intermediate_size if arch == "mixtral" else self.intermediate_size // 2

    def num_experts(self, arch: str) -> int:
        """How many experts a layer of ``arch`` (a mixture of experts) has as ``create-model`` writes it."""
        return GLM_EXPERTS if arch == "glm4_moe" else NUM_EXPERTS

    def num_parameters(self, arch: str = "llama", tie_word_embeddings: bool | None = None) -> int:
        """Parameter count of this preset as ``arch`` (analytic; matches the HF model's count)."""
        tied = self.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if arch in ("qwen2", "qwen2_moe", "seed_oss", "glm4_moe", "gpt_oss"):  # q/k/v biases
            attn += q + 2 * kv
        if arch == "gpt_oss":  # the output projection's bias, each head's sink
            attn += h + self.num_attention_heads
        if arch in ("qwen3", "gemma3"):  # q and k RMSNorm over each head
            attn += 2 * self.head_dim
        if arch in ("olmo2", "olmo3", "olmoe"):  # q and k RMSNorm over all their heads (OLMo 2 and 3: no input norm;
            # below: the two output norms)
            attn += q + kv
        if arch in ("qwen3_moe", "glm4_moe"):  # q and k RMSNorm over each head
            attn += 2 * self.head_dim
        dense = mlp = 3 * h * self.intermediate_size
        if arch in MOE_ARCHS:  # the router, and each expert (half the preset's width but Mixtral's)
            mlp = self.num_experts(arch) * (h + 3 * h * self.expert_size(arch))
            if arch == "qwen2_moe":  # the shared expert (the preset's MLP width) and its gate
                mlp += 3 * h * self.intermediate_size + h
            if arch == "glm4_moe":  # one shared expert as wide as the others (its router's correction bias: a buffer)
                mlp += 3 * h * self.expert_size(arch)
            if arch == "gpt_oss":  # the router's bias, each expert's gate/up and down biases
                mlp += self.num_experts(arch) * (1 + 2 * self.expert_size(arch) + h)
        norms = (4 if arch.startswith("gemma") else 2) * h  # input, post-attention RMSNorm (Gemma: 2 more)
        dense_layers = min(GLM_DENSE_LAYERS, self.num_hidden_layers) if arch == "glm4_moe" else 0
        layers = self.num_hidden_layers * (attn + mlp + norms) + dense_layers * (dense - mlp)
        embed = self.vocab_size * h
        return layers + h + embed * (1 if tied else 2)


PRESETS: dict[str, ModelPreset] = {
    # For tests: 2 layers, GQA (4 query heads share 2 KV heads). The vocabulary is the same 8192-token
    # one as "small" (trained once per process); a smaller one would make prompts longer.
    "tiny": ModelPreset(
        name="tiny", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=176, vocab_size=8192, max_position_embeddings=512,
    ),
    # About 31M parameters (untied embeddings): big enough for benchmarks, small enough for a CPU.
    "small": ModelPreset(
        name="small", num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1408, vocab_size=8192, max_position_embeddings=2048, rope_theta=500000.0,
    ),
    # About 288M parameters (24 layers, hidden 1024): for benchmarks on a GPU, where "small" is launch-bound.
    "medium": ModelPreset(
        name="medium", num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=2816, vocab_size=8192, max_position_embeddings=2048, rope_theta=500000.0,
    ),
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; ``ValueError`` naming the ``preset`` field if there is none."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"preset: unknown preset {name!r} (choose from {', '.join(PRESETS)})") from None
