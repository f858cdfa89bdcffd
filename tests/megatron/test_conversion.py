"""HF <-> Megatron weights for Llama, Qwen2 and Qwen3 on CPU (TP=1): the same logits, an exact round trip."""

from __future__ import annotations

import pytest
import torch
import transformers

from miles_core.errors import MilesError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def megatron():
    """A one-rank gloo world with megatron-core's parallel state (shared with the other in-process tests)."""
    from miles_plugins_megatron.causal_lm import ensure_single_rank_parallel_state
    from miles_plugins_megatron.cpu_compat import causal_mask

    from miles_plugins_megatron import conversion, model

    ensure_single_rank_parallel_state()
    return conversion, model, causal_mask


CONFIGS = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2-qkv-bias": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3-qk-norm": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=24),
}


def hf_model(model_type: str, **overrides) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.for_model(
        model_type,
        **{
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 112,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            **overrides,
        },
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for parameter in model.parameters():  # norms too: a swapped gate/up or q/k must not go unnoticed
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_megatron_model_matches_transformers(megatron, name: str) -> None:
    conversion, model_builder, causal_mask = megatron
    settings = dict(CONFIGS[name])
    reference = hf_model(settings.pop("model_type"), **settings)
    config = reference.config
    gpt = model_builder.build_gpt_model(config).eval()
    converted = conversion.hf_to_megatron(reference.state_dict(), config)
    missing, unexpected = gpt.load_state_dict(converted, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    input_ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11).expand(2, -1)
    with torch.no_grad():
        ours = gpt(input_ids=input_ids, position_ids=positions, attention_mask=causal_mask(11))
        expected = reference(input_ids).logits
    assert (ours - expected).abs().max().item() < 1e-5

    back = conversion.megatron_to_hf({k: v for k, v in gpt.state_dict().items() if "_extra_state" not in k}, config)
    hf_state = {
        k: v for k, v in reference.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    assert sorted(back) == sorted(hf_state)
    for key, tensor in hf_state.items():
        assert torch.equal(back[key], tensor), key


def test_unsupported_architecture_and_bad_tensor_parallel(megatron) -> None:
    conversion, model_builder, _ = megatron
    gpt2 = transformers.GPT2Config()
    with pytest.raises(MilesError, match="unsupported architecture 'gpt2'"):
        conversion.hf_to_megatron({}, gpt2)
    llama = hf_model("llama").config
    with pytest.raises(MilesError, match=r"tensor parallel size 4 must divide .* key/value heads \(2\)"):
        model_builder.transformer_config(llama, tensor_parallel=4)
    odd_vocabulary = hf_model("llama", vocab_size=97).config
    with pytest.raises(MilesError, match=r"tensor parallel size 2 must divide the vocabulary \(97\)"):
        conversion.check_tensor_parallel(odd_vocabulary, 2)
