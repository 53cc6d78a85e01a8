"""The chunked LM head + cross-entropy and CPU-saved activations give the naive path's loss and
gradients (one process here; with sequence parallelism and ZeRO-3 in test_sequence_parallel.py)."""

import importlib.util

import pytest
import torch

from longsft.train.data.batching import collate
from longsft.train.data.encoding import encode_all
from longsft.train.data.schema import load_samples
from longsft.train.model.loss import FUSED_LOSS, token_loss_sum


def _grads(model, batch, **kw):
    model.zero_grad()
    loss, n = token_loss_sum(model, batch, **kw)
    loss.backward()
    return loss.item(), n, {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # tied and untied LM head
def test_chunked_loss_and_offload_equal_the_naive_path(tiny_model_dir, sample_dir, tokenizer, arch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})  # as build_model
    model.train()
    items, _ = encode_all(load_samples(sample_dir / "512" / "train.jsonl")[:2], tokenizer, 512, "end", "truncate")
    batch = collate(items[:1], tokenizer.pad_token_id)
    batch.pop("doc_ids")
    ref_loss, n, ref = _grads(model, batch)
    assert n > 8
    for kw in ({"chunk_tokens": 1}, {"chunk_tokens": 5}, {"chunk_tokens": 10_000}, {"offload_activations": True},
               {"chunk_tokens": 3, "offload_activations": True}):
        loss, n2, got = _grads(model, batch, **kw)
        assert n2 == n and loss == pytest.approx(ref_loss, rel=1e-6), kw
        assert set(got) == set(ref)
        for k, g in ref.items():
            err = ((got[k] - g).norm() / g.norm().clamp_min(1e-12)).item()
            assert err < 1e-4, (kw, k, err)  # fp32; chunks change the summation order


def test_token_loss_sum_equals_full_logits_cross_entropy(tiny_model_dir, sample_dir, tokenizer):
    """The anchor of every equivalence test: a padded two-row batch (and each loss path) against a plain
    forward, full logits and ``F.cross_entropy`` over each sample's own shifted answer labels."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from longsft.train.training.step import n_targets

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)  # untied head
    items, _ = encode_all(load_samples(sample_dir / "512" / "train.jsonl")[:2], tokenizer, 512, "end", "truncate")
    assert len(items[0].input_ids) != len(items[1].input_ids)  # the shorter row is padded
    want, count = torch.zeros(()), 0
    for e in items:
        logits = model(input_ids=torch.tensor([e.input_ids])).logits[0]
        target = torch.tensor(e.labels[1:])
        keep = target != -100
        want = want + F.cross_entropy(logits[:-1][keep], target[keep], reduction="sum")
        count += int(keep.sum())
    batch = collate(items, tokenizer.pad_token_id)
    batch.pop("doc_ids")
    assert sum(n_targets([e]) for e in items) == count  # the trainer's normaliser counts the same tokens
    for kw in ({}, {"chunk_tokens": 4}):
        got, n = token_loss_sum(model, batch, **kw)
        assert n == count and got.item() == pytest.approx(want.item(), rel=1e-5), kw


def test_the_chunked_loss_caps_logits_as_the_model_does():
    """Gemma-2's forward caps its logits (final_logit_softcapping): the chunked head must too."""
    import torch.nn.functional as F
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
                       attn_implementation="eager")
    model = Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (1, 24))
    labels = torch.full_like(ids, -100)
    labels[0, 10:23] = ids[0, 11:24]
    batch = {"input_ids": ids, "position_ids": torch.arange(24)[None], "shift_labels": labels,
             "attention_mask": torch.ones_like(ids)}
    logits = model(input_ids=ids).logits[0]  # capped by the model: |logit| < 0.5
    assert logits.abs().max() < 0.5
    want = F.cross_entropy(logits[10:23], ids[0, 11:24], reduction="sum")
    for kw in ({}, {"chunk_tokens": 4}):
        got, n = token_loss_sum(model, batch, **kw)
        assert n == 13 and got.item() == pytest.approx(want.item(), rel=1e-5), kw


@pytest.mark.parametrize("n, chunk", [(4, 0), (4, 3), (20, 7)])  # more than hidden / 2 rows: recomputed
def test_a_tied_head_gradient_deferred_to_the_embedding_equals_autograd(n, chunk):
    """HeadCrossEntropy leaves the tied weight's head share for the embedding's backward to add: the
    weight gradient equals plain autograd's (lookup + head), the padding row's head share included."""
    import torch.nn.functional as F

    from longsft.train.model.tied_head import Deferred, HeadCrossEntropy, defer_into_embedding

    torch.manual_seed(0)
    V, H, pad = 50, 8, 3
    emb = torch.nn.Embedding(V, H, padding_idx=pad)
    head = type("Tied", (torch.nn.Module,), {"get_input_embeddings": lambda self: emb})()
    proj = torch.randn(H, H)
    ids = torch.randint(0, V, (2, 16))
    ids[0, :4] = pad  # padding: no gradient from the lookup
    targets = ids.reshape(-1)[-n:].clone()
    targets[0] = pad  # ... but the head's share for its row

    def run(deferred):
        emb.weight.grad = None
        if deferred is not None:
            defer_into_embedding(head, deferred)
        x = emb(ids)
        h = torch.tanh(x @ proj).reshape(-1, H)[-n:]  # [n, H]: the decoder's last hidden states
        loss = F.cross_entropy(h @ emb.weight.t(), targets, reduction="sum") if deferred is None else \
            HeadCrossEntropy.apply(h, emb.weight, targets, chunk or n, deferred)
        loss.backward()
        return loss.item(), emb.weight.grad.clone()

    want_loss, want = run(None)
    deferred = Deferred()
    got_loss, got = run(deferred)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    assert got[pad].abs().sum() > 0 and not deferred.parts  # the head's share of the padding row; all folded


def test_the_tied_embedding_gradient_adds_no_repeated_row_in_half_precision():
    """On CUDA a bf16 ``index_add_`` adds repeated ids one atomic at a time, rounding after each: the lookup's
    gradient must reach a half-precision tensor with each row once (its copies summed in fp32), and equal
    the fp32 sum rounded once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from longsft.train.model.tied_head import Deferred, HeadCrossEntropy, defer_into_embedding

    class Adds(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.half_rows: list[tuple[int, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.index_add_.default, torch.ops.aten.index_add.default) and \
                    args[0].dtype in (torch.bfloat16, torch.float16):
                self.half_rows.append((args[2].numel(), args[2].unique().numel()))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    V, H = 40, 8
    emb = torch.nn.Embedding(V, H).to(torch.bfloat16)
    head = type("Tied", (torch.nn.Module,), {"get_input_embeddings": lambda self: emb})()
    ids = torch.cat([torch.zeros(1, 3000, dtype=torch.long), torch.randint(0, V, (1, 200))], dim=1)  # token 0 x3000+
    deferred = Deferred()
    defer_into_embedding(head, deferred)
    h = emb(ids).reshape(-1, H)[-4:]
    g = torch.rand(ids.shape[1], H)
    with Adds() as adds:
        (HeadCrossEntropy.apply(h.float().to(torch.bfloat16), emb.weight, ids[0, -4:], 4, deferred)
         + (emb(ids).reshape(-1, H).float() * g).sum()).backward()
    assert adds.half_rows and all(n == unique for n, unique in adds.half_rows), adds.half_rows
    from longsft.train.model.tied_head import _add_rows

    gb = g.to(torch.bfloat16)
    want = torch.zeros(V, H).index_add_(0, ids.reshape(-1), gb.float()).to(torch.bfloat16)  # fp32, rounded once
    assert torch.equal(_add_rows(torch.zeros(V, H, dtype=torch.bfloat16), ids.reshape(-1), gb), want)


def test_no_dense_tied_head_gradient_while_the_layers_run_backward():
    """The point of deferring: at each decoder layer's backward the tied head's [V, H] gradient does not
    exist yet (live tensors counted as the planner counts them); gradients equal the plain path's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from longsft.train.common.compat import storage_id
    from longsft.train.model.loss import attach_fused_loss
    from longsft.train.plan.trace import _LiveBytes

    V, H = 20000, 256  # 23 target rows: their dlogits (kept, 23 / 256 of [V, H]) wait instead of [V, H]
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, use_cache=False)
    ids = torch.randint(0, V, (1, 64), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[0, 40:63] = ids[0, 41:]
    batch = {"input_ids": ids, "position_ids": torch.arange(64)[None], "shift_labels": labels}

    def run(defer: bool):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg).train()
        if defer:
            attach_fused_loss(model, "tied")
        at_layers = []
        live = _LiveBytes({storage_id(p.untyped_storage()) for p in model.parameters()})
        hooks = [layer.register_full_backward_pre_hook(lambda *_: at_layers.append(live.now)) for layer in
                 model.model.layers]
        with live:
            loss, _ = token_loss_sum(model, batch)
            loss.backward()
        for h in hooks:
            h.remove()
        return min(at_layers), model.get_input_embeddings().weight.grad

    plain_live, plain_grad = run(False)
    live, grad = run(True)
    assert plain_live - live > 0.9 * (V * H - 23 * V) * 4, (plain_live, live)  # fp32 [V, H] less the dlogits
    assert ((grad - plain_grad).norm() / plain_grad.norm()).item() < 1e-5


def test_negative_chunk_is_refused():
    from longsft.train.common.errors import ConfigError
    from longsft.train.config.checks import validate
    from longsft.train.config.recipes import load_config

    with pytest.raises(ConfigError, match="model.loss_chunk_tokens=-1 must be >= 0"):
        validate(load_config("tiny", ["model.loss_chunk_tokens=-1"]))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiled_mlp_equals_the_whole_sequence(tiny_model_dir, sample_dir, tokenizer, arch):
    import dataclasses

    from longsft.train.config.schema import ModelConfig
    from longsft.train.model.build import build_model

    base = ModelConfig(path=str(tiny_model_dir(arch)), tokenizer="qwen", dtype="fp32")
    items, _ = encode_all(load_samples(sample_dir / "512" / "train.jsonl")[:1], tokenizer, 512, "end", "truncate")
    batch = collate(items, tokenizer.pad_token_id)
    batch.pop("doc_ids")
    ref_loss, n, ref = _grads(build_model(base), batch)
    assert batch["input_ids"].shape[1] % 37  # the last tile is a short one
    for kw in ({"mlp_tile_tokens": 37}, {"mlp_tile_tokens": 37, "gradient_checkpointing": False}):
        model = build_model(dataclasses.replace(base, **kw))
        assert "model.layers.0.mlp.gate_proj.weight" in model.state_dict()  # checkpoints keep their names
        loss, n2, got = _grads(model, batch, chunk_tokens=16)
        assert n2 == n and loss == pytest.approx(ref_loss, rel=1e-6), kw
        assert set(got) == set(ref)
        for k, g in ref.items():
            err = ((got[k] - g).norm() / g.norm().clamp_min(1e-12)).item()
            assert err < 1e-4, (kw, k, err)


@pytest.mark.parametrize("arch, swiglu, rmsnorm", [("Qwen3", 2, 9), ("Llama", 2, 5), ("Qwen2", 2, 5), ("Mistral", 2, 5),
                                                    ("Phi3", 0, 5), ("Gemma", 0, 0)])
def test_lean_layers_equal_the_model_s_own(arch, swiglu, rmsnorm):
    """SwiGLU MLPs and RMSNorms whose class's forward is exactly transformers' run autograd functions that
    keep less (an MLP: one [tokens, intermediate] tensor fewer), with the model's loss and every gradient;
    others are left alone: Phi-3's fused gate_up MLP, Gemma's GELU MLP and its (1 + weight) norm."""
    import transformers

    from longsft.train.model.layers import lean_layers

    cfg = getattr(transformers, f"{arch}Config")(hidden_size=16, intermediate_size=48, num_attention_heads=2,
                                                 num_key_value_heads=1, head_dim=8, num_hidden_layers=2,
                                                 vocab_size=64, pad_token_id=0)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).train()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    mlp, x = model.model.layers[0].mlp, torch.randn(1, 7, 16)

    def kept(module) -> int:  # elements of the distinct tensors a forward keeps for its backward
        seen = {}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.setdefault(t.data_ptr(), t.numel()) and t,
                                                      lambda t: t):
            module(x.clone().requires_grad_())
        return sum(seen.values())

    def run():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, kept(mlp), kept(model.model.norm)

    want_loss, want, mlp_kept, norm_kept = run()
    assert lean_layers(model) == {"swiglu": swiglu, "rmsnorm": rmsnorm}
    loss, got, mlp_now, norm_now = run()
    assert mlp_now == mlp_kept - (7 * 48 if swiglu else 0)  # one [tokens, intermediate] tensor fewer
    assert norm_now == norm_kept - (7 * 16 if rmsnorm else 0)  # the normalised [tokens, hidden] not kept
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name, g in want.items():
        assert ((got[name] - g).norm() / g.norm().clamp_min(1e-12)).item() < 1e-5, name


def test_silu_mul_backward_in_pieces_equals_autograd():
    """SiluMul's backward writes its gradients over gate and up, ROWS tokens at a time (a short last piece)."""
    import torch.nn.functional as F

    from longsft.train.model.layers import ROWS, SiluMul

    a, b = (torch.randn(2, ROWS + 5, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    g = torch.randn(2, ROWS + 5, 6, dtype=torch.float64)
    want = torch.autograd.grad(F.silu(a) * b, (a, b), g)
    out = SiluMul.apply(a.clone(), b.clone())  # fresh tensors, as the projections' outputs are
    assert torch.allclose(out, F.silu(a) * b)
    got = torch.autograd.grad(out, (a, b), g)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed")
def test_liger_without_the_package_is_refused_with_the_fix():
    from longsft.train.common.errors import ConfigError
    from longsft.train.config.checks import validate
    from longsft.train.config.recipes import load_config

    with pytest.raises(ConfigError, match="model.loss_kernel=liger needs the liger-kernel package"):
        validate(load_config("tiny", ["model.loss_kernel=liger"]))


def test_the_loss_keeps_no_layer_output_alive(tiny_model_dir, sample_dir, tokenizer):
    """At the LM head, no decoder layer's output may still be referenced by the loss path.

    Saved tensors are *copied* here, as ``model.offload_activations`` copies them to the host on a
    GPU (on CPU ``save_on_cpu`` keeps the very tensor, so it would hide the difference): whatever
    still holds a layer's output at the loss is then memory the GPU keeps. ``output_hidden_states=True``
    held every layer's (L x [tokens, hidden]), which the planner counts as offloaded.
    """
    import weakref

    from longsft.train.config.schema import ModelConfig
    from longsft.train.model.build import build_model

    model = build_model(ModelConfig(path=str(tiny_model_dir("qwen3")), tokenizer="qwen", dtype="fp32"))
    items, _ = encode_all(load_samples(sample_dir / "512" / "train.jsonl")[:1], tokenizer, 512, "end", "truncate")
    batch = collate(items, tokenizer.pad_token_id)
    batch.pop("doc_ids")
    outputs, alive_at_head = [], []

    def remember(_module, _args, out):
        outputs.append(weakref.ref(out[0] if isinstance(out, tuple) else out))

    def count(_module, _args):
        alive_at_head.append(sum(ref() is not None for ref in outputs))

    hooks = [layer.register_forward_hook(remember) for layer in model.model.layers]
    head = getattr(model, FUSED_LOSS, None) or model.get_output_embeddings()  # the tied head's loss module
    hooks.append(head.register_forward_pre_hook(count))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        loss, _ = token_loss_sum(model, batch, chunk_tokens=64)
    for h in hooks:
        h.remove()
    assert len(outputs) == len(model.model.layers) and alive_at_head
    assert max(alive_at_head) == 0, f"{max(alive_at_head)} layer outputs alive at the LM head"
    loss.backward()  # the copies were enough for the backward


@pytest.fixture
def liger_cpu(monkeypatch):
    """Liger's entry point on CPU (tests/liger_cpu: its chunking and its gradients-in-forward)."""
    import sys

    from conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "liger_cpu"))
    yield
    for name in [m for m in sys.modules if m == "liger_kernel" or m.startswith("liger_kernel.")]:
        del sys.modules[name]


def test_liger_without_targets_gives_zero_not_a_division_by_zero(liger_cpu, tiny_model_dir):
    """Under SP the answer sits on one rank; the others call the fused loss with no rows."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    from longsft.train.config.schema import ModelConfig
    from longsft.train.model.build import build_model
    from longsft.train.model.loss import fused_head_loss

    weight = torch.randn(100, 16, requires_grad=True)
    with pytest.raises(ZeroDivisionError):  # what Liger's host code does with no rows
        LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, torch.zeros(0, 16), torch.zeros(0, dtype=torch.long))
    model = build_model(ModelConfig(path=str(tiny_model_dir("qwen3", tied=False)), tokenizer="qwen", dtype="fp32",
                                    loss_kernel="liger"))
    hidden = torch.zeros(0, model.config.hidden_size, requires_grad=True)
    loss = fused_head_loss(model)(hidden, torch.zeros(0, dtype=torch.long))
    loss.backward()
    head = model.get_output_embeddings().weight
    assert loss.item() == 0 and head.grad is not None and not head.grad.any()


@pytest.mark.parametrize("arch, tied", [("qwen3", True), ("llama", False)])
def test_liger_equals_the_naive_path(liger_cpu, tiny_model_dir, sample_dir, tokenizer, arch, tied):
    from longsft.train.config.schema import ModelConfig
    from longsft.train.model.build import build_model

    model = build_model(ModelConfig(path=str(tiny_model_dir(arch, tied)), tokenizer="qwen", dtype="fp32",
                                    loss_kernel="liger"))
    assert not any("fused" in k for k in model.state_dict())  # checkpoints unchanged
    items, _ = encode_all(load_samples(sample_dir / "512" / "train.jsonl")[:1], tokenizer, 512, "end", "truncate")
    batch = collate(items, tokenizer.pad_token_id)
    batch.pop("doc_ids")
    ref_loss, n, ref = _grads(model, batch)
    loss, n2, got = _grads(model, batch, kernel="liger")
    assert n2 == n and loss == pytest.approx(ref_loss, rel=1e-6)
    assert set(got) == set(ref)
    for k, g in ref.items():
        assert ((got[k] - g).norm() / g.norm().clamp_min(1e-12)).item() < 1e-4, k
