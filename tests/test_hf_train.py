"""A training step through transformers on the kernels, as on an H100 (autoflash.emulate("h100")): a
tiny, randomly initialised Llama (GQA, head dim 64, bf16) on attn_implementation="autofa" runs
loss.backward() with the sm90 family in both directions (the FlashAttention-3-style forward and
backward), and its loss and gradients are those of the same model in fp32 within twice the error of
PyTorch's own bf16 ("sdpa" in bf16)."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autoflash
import autoflash.hf
from autoflash.kernels import launch

VOCAB, SEQ = 128, 40  # 40 tokens: ragged query and key tiles
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=64,
                     initializer_range=0.1)


def _loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_training_step_runs_the_sm90_family_both_ways_and_matches_sdpa(monkeypatch):
    """Gradients against the same model in fp32 on "sdpa", with bf16 "sdpa" as the yardstick (as
    FlashAttention's rule takes PyTorch in the input dtype): per weight, the relative error at most
    twice the yardstick's, plus 1e-3."""
    autoflash.hf.register()
    torch.manual_seed(0)
    ours = LlamaForCausalLM._from_config(copy.deepcopy(CONFIG), attn_implementation=autoflash.hf.NAME).bfloat16()
    yard = LlamaForCausalLM._from_config(copy.deepcopy(CONFIG), attn_implementation="sdpa").bfloat16()
    ref = LlamaForCausalLM._from_config(copy.deepcopy(CONFIG), attn_implementation="sdpa")
    yard.load_state_dict(ours.state_dict())
    ref.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))

    kernels = []
    real = launch.kernel_functions

    def spy(config, profile, t):
        kernels.append(config.name)
        return real(config, profile, t)

    monkeypatch.setattr(launch, "kernel_functions", spy)
    with autoflash.emulate("h100"):
        loss, grads = _loss_and_grads(ours, ids)
    yard_loss, yard_grads = _loss_and_grads(yard, ids)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)

    layers = CONFIG.num_hidden_layers
    assert sum(n.startswith("fwd_hd64_bf16_causal") and "_sm90a" in n for n in kernels) == layers, kernels
    assert sum(n.startswith("bwd_hd64_bf16_causal") and n.endswith("_sm90a") for n in kernels) == layers, kernels
    assert abs(loss - ref_loss) <= 2 * abs(yard_loss - ref_loss) + 1e-3 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()

    def rel(g, name):
        return ((g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)).item()

    for name, g in grads.items():  # every weight's gradient flows through attention's backward
        ours_err, yard_err = rel(g, name), rel(yard_grads[name], name)
        assert ours_err <= 2 * yard_err + 1e-3, f"{name}: relative error {ours_err:.4f} > 2 x {yard_err:.4f} + 1e-3"
