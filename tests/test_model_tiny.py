"""The tiny decoder: a real transformer whose prefill continues exactly from past KV.

Tolerances versus a full recompute (stated in the README and the demo): max |Δlogit| <= 1e-4 in
float32 and <= 5e-2 in bfloat16. Continuing from the *same* past KV is bit-identical.
"""

import pytest
import torch

from tierstore import InvalidInputError, InvalidTypeError
from tierstore.models import TinyConfig, TinyDecoder

CFG = TinyConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, seed=7)
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def model(request):
    return TinyDecoder(CFG, dtype=request.param)


def tokens(n, seed=0):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_weights_are_deterministic_and_seeded():
    a, b = TinyDecoder(CFG), TinyDecoder(CFG)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    c = TinyDecoder(TinyConfig(**{**CFG.__dict__, "seed": 8}))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert CFG.revision != c.config.revision
    assert a.namespace_fields() == {"model": CFG.name, "revision": CFG.revision, "dtype": "float32"}


def test_kv_shape_and_dtype(model):
    out = model.prefill(tokens(37))
    assert out.logits.shape == (37, CFG.vocab_size) and out.logits.dtype == torch.float32
    assert len(out.kv) == CFG.num_hidden_layers
    assert all(t.shape == (2, 37, CFG.num_key_value_heads, CFG.head_dim) and t.dtype == model.dtype for t in out.kv)
    assert CFG.kv_bytes_per_token(model.dtype) == sum(t[:, :1].numel() for t in out.kv) * out.kv[0].element_size()


def test_prefill_is_deterministic(model):
    ids = tokens(50)
    a, b = model.prefill(ids), model.prefill(ids)
    assert torch.equal(a.logits, b.logits) and all(torch.equal(x, y) for x, y in zip(a.kv, b.kv, strict=True))


def test_split_continuation_is_bit_identical_given_the_same_past(model):
    ids = tokens(96, seed=1)
    prefix = model.prefill(ids[:64])
    copied = [t.clone() for t in prefix.kv]  # what a lossless store hands back
    a = model.prefill(ids[64:], prefix.kv)
    b = model.prefill(ids[64:], copied)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x[:, :64], y) for x, y in zip(a.kv, prefix.kv, strict=True))


def test_before_layer_runs_before_each_layer_in_order(model):
    """The hook an engine's layer-wise KV wait sits in: layer i runs only after before_layer(i) returned."""
    ids = tokens(96, seed=2)
    prefix = model.prefill(ids[:64])
    seen, ran = [], []
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: ran.append((i, list(seen))))
             for i, layer in enumerate(model.layers)]
    try:
        out = model.prefill(ids[64:], prefix.kv, before_layer=seen.append)
    finally:
        for h in hooks:
            h.remove()
    n = len(model.layers)
    assert seen == list(range(n)) and ran == [(i, list(range(i + 1))) for i in range(n)]
    assert torch.equal(out.logits, model.prefill(ids[64:], prefix.kv).logits)


def test_split_matches_full_recompute_within_tolerance(model):
    ids = tokens(96, seed=2)
    full = model.prefill(ids)
    split = model.prefill(ids[64:], model.prefill(ids[:64]).kv)
    diff = (split.logits - full.logits[64:]).abs().max().item()
    assert diff <= TOL[model.dtype], diff
    kv_diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(split.kv, full.kv, strict=True))
    assert kv_diff <= TOL[model.dtype]


def test_attention_is_causal_and_position_aware(model):
    ids = tokens(40, seed=3)
    full = model.prefill(ids).logits
    assert (model.prefill(ids[:25]).logits - full[:25]).abs().max().item() <= TOL[model.dtype]
    # a wrong past (other tokens) changes the continuation: the model really attends to its KV
    other = model.prefill(tokens(25, seed=4)).kv
    assert not torch.allclose(model.prefill(ids[25:], other).logits, full[25:], atol=1e-3)
    # rotary: the same token at another position gets another key
    k = model.prefill(torch.tensor([9, 9, 9])).kv[0][0]
    assert not torch.equal(k[0], k[1])


def test_generate_is_greedy_decoding(model):
    ids = tokens(20, seed=5)
    gen, kv = model.generate(ids, max_new_tokens=4)
    assert len(gen) == 4 and kv[0].shape[1] == 23
    seq = ids.tolist()
    for g in gen:
        assert int(model.prefill(seq).logits[-1].argmax()) == g
        seq.append(g)


def test_bad_input(model):
    kv = model.prefill(tokens(8)).kv
    with pytest.raises(InvalidInputError, match="at least one"):
        model.prefill([])
    with pytest.raises(InvalidInputError, match="vocab_size"):
        model.prefill([CFG.vocab_size])
    with pytest.raises(InvalidTypeError):
        model.prefill([1.5])
    with pytest.raises(InvalidInputError, match="layers"):
        model.prefill([1], kv[:1])
    with pytest.raises(InvalidInputError, match="past\\[0\\]"):
        model.prefill([1], [kv[0][:, :, :1]] + kv[1:])
    with pytest.raises(InvalidInputError, match="like every layer"):
        model.prefill([1], [kv[0], kv[1][:, :4]])
    other = torch.float32 if model.dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(InvalidInputError, match="dtype"):
        model.prefill([1], [t.to(other) for t in kv])
    with pytest.raises(InvalidTypeError):
        model.prefill([1], kv[0])
    with pytest.raises(InvalidInputError):
        TinyConfig(num_attention_heads=3, num_key_value_heads=2)
