import pytest
import torch

from kvlab.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from kvlab.model import ModelLoadError, dense_generate, dense_logits, load_model
from kvlab.model.attention_api import DenseCausalAttention
from kvlab.model.mini import build_mini, mini_config
from kvlab.tokenizer import ByteTokenizer


@pytest.mark.parametrize(
    ("name", "kv_heads", "kind"), [("mini", 4, "MHA"), ("mini-gqa", 2, "GQA"), ("mini-mqa", 1, "MQA")]
)
def test_mini_variants_shapes(name: str, kv_heads: int, kind: str) -> None:
    lm = load_model(name)
    cfg = lm.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (4, 128, 4, kv_heads)
    assert cfg.attention_kind == kind
    attn = lm.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((4 + 2 * kv_heads) * 32, 128)
    logits = dense_logits(lm.model, [1, 2, 3, 4, 5])
    assert logits.shape == (5, ByteTokenizer.vocab_size)
    assert torch.isfinite(logits).all()


def test_same_seed_bit_identical_other_seed_differs() -> None:
    a = build_mini(mini_config(), seed=7)
    torch.manual_seed(123)  # the global RNG must not matter
    b = build_mini(mini_config(), seed=7)
    c = build_mini(mini_config(), seed=8)
    for (na, pa), (_, pb), (_, pc) in zip(
        a.state_dict().items(), b.state_dict().items(), c.state_dict().items(), strict=True
    ):
        assert torch.equal(pa, pb), na
        if not na.endswith("norm.weight"):
            assert not torch.equal(pa, pc), na


def test_mini_weights_are_pinned() -> None:
    # Guards "same seed gives the same weights on any machine": a change of init order or scale shows here.
    w = build_mini(mini_config(), seed=0).embed_tokens.weight
    expected = torch.Generator().manual_seed(0)
    assert torch.equal(w, torch.randn(w.shape, generator=expected))


@pytest.mark.parametrize(
    "text", ["", "hello", "请把以下内容翻译成英文：今天天气很好", "emoji 🙂👍🏽 mix 中文", "\x00\n\t"]
)
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_skips_specials_and_survives_bad_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.decode([tok.BOS, *tok.encode("ok"), tok.EOS]) == "ok"
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"


def test_dense_batch_attention_isolates_sequences() -> None:
    model = build_mini(mini_config(2))
    a, b = [5, 6, 7, 8], [9, 10, 11]
    ids = torch.tensor(a + b)
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    with torch.inference_mode():
        both = model.compute_logits(model(ids, pos, DenseCausalAttention([0, 4, 7], 4)))
    torch.testing.assert_close(both[:4], dense_logits(model, a), rtol=0, atol=1e-5)
    torch.testing.assert_close(both[4:], dense_logits(model, b), rtol=0, atol=1e-5)


def test_dense_generate_is_recompute_of_argmax() -> None:
    model = build_mini(mini_config())
    prompt = ByteTokenizer().encode("请把以下内容翻译成英文：今天天气很好")
    out, logits = dense_generate(model, prompt, 5, return_logits=True)
    assert len(out) == 5 and logits.shape == (5, ByteTokenizer.vocab_size)
    for i, token in enumerate(out):
        assert token == int(dense_logits(model, prompt + out[:i])[-1].argmax())


def test_seed_prompts_have_distinct_continuations() -> None:
    # The passphrase experiment is only informative if the two seed prompts continue differently.
    model = build_mini(mini_config())
    tok = ByteTokenizer()
    a = dense_generate(model, tok.encode("请把以下内容翻译成英文：今天天气很好"), 8)
    b = dense_generate(model, tok.encode("请把以下内容翻译成英文：今天天气很差"), 8)
    assert a != b


def test_model_config_errors_name_field_and_range() -> None:
    base = mini_config()
    with pytest.raises(ConfigError, match=r"num_kv_heads must divide num_heads=4 \(allowed: \[1, 2, 4\]\), got 3"):
        base.replace(num_kv_heads=3)
    with pytest.raises(ConfigError, match=r"ModelConfig.hidden_size must be >= 1, got 0"):
        base.replace(hidden_size=0)
    with pytest.raises(ConfigError, match=r"ModelConfig.num_kv_heads must be in \[1, 4\], got 8"):
        base.replace(num_kv_heads=8)
    with pytest.raises(ConfigError, match="head_dim must be even"):
        base.replace(head_dim=33)
    with pytest.raises(ConfigError, match="rope_theta must be > 0"):
        base.replace(rope_theta=0.0)


def test_cache_and_scheduler_config_validation() -> None:
    with pytest.raises(ConfigError, match=r"CacheConfig.layout must be one of \['NHD', 'HND'\]"):
        CacheConfig(layout="NCHW")
    with pytest.raises(ConfigError, match="CacheConfig.block_size must be in"):
        CacheConfig(block_size=0)
    with pytest.raises(ConfigError, match="refused unless unsafe=True"):
        CacheConfig(copy_on_write=False)
    with pytest.raises(ConfigError, match="refused unless unsafe=True"):
        CacheConfig(hash_algo="weak")
    assert CacheConfig(copy_on_write=False, unsafe=True).unsafe_settings == ["copy_on_write=False"]
    assert CacheConfig(share_prefix=False, copy_on_write=False).unsafe_settings == []
    with pytest.raises(ConfigError, match="filter_empty=False"):
        SchedulerConfig(filter_empty=False)
    with pytest.raises(ConfigError, match="max_num_seqs must be >= 1"):
        SchedulerConfig(max_num_seqs=0)


def test_unknown_preset_and_missing_path() -> None:
    with pytest.raises(ModelLoadError, match=r"unknown model 'mega'.*mini, mini-gqa, mini-mqa, smollm2"):
        load_model("mega")
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model("/nonexistent/model/dir")


def test_model_config_is_frozen() -> None:
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=16,
    )
    with pytest.raises(AttributeError):
        cfg.hidden_size = 16  # type: ignore[misc]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_reference_formula_bit_for_bit(dtype: torch.dtype) -> None:
    """The fused op must not move the logits the oracle and the HF comparisons check."""
    from kvlab.model.llama import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    norm.to(dtype)
    for rows in (1, 7, 300):
        x = (3 * torch.randn(rows, 96, generator=gen)).to(dtype)
        xf = x.float()
        expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(norm(x), expected)
