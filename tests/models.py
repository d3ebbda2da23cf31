"""Tiny random models built from configs, and helpers shared by the tests."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from peft_sparse import SparseLayer


def tiny_llama(seed: int = 0, dtype=torch.float32, hidden_size: int = 32, intermediate_size: int = 48):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=97, bos_token_id=0, eos_token_id=0, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).eval()


def tiny_bert(seed: int = 0):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config).eval()


def tiny_mixtral(seed: int = 0, experts_implementation: str = "grouped_mm", experts: int = 4):
    """A tiny MixtralForCausalLM: per layer ``mlp.experts.gate_up_proj`` (E, 48, 32) and ``down_proj`` (E, 32, 24)."""
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    config._experts_implementation = experts_implementation
    return MixtralForCausalLM(config).eval()


def tiny_qwen3_moe(seed: int = 0, experts_implementation: str = "grouped_mm"):
    """A tiny Qwen3MoeForCausalLM: per layer ``mlp.experts.gate_up_proj`` (4, 32, 32) and ``down_proj`` (4, 32, 16)."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    config._experts_implementation = experts_implementation
    return Qwen3MoeForCausalLM(config).eval()


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

# name → (builder, target_modules, output accessor)
MODELS = {
    "llama": (tiny_llama, "all-linear", lambda out: out.logits),
    "gpt2": (tiny_gpt2, ["c_attn", "c_proj", "c_fc"], lambda out: out.logits),
    "bert": (tiny_bert, ["query", "key", "value", "dense"], lambda out: out.logits),
}


def inputs(seed: int = 1, batch: int = 2, length: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (batch, length), generator=g)


def randomize_values(model, adapter_name: str = "default", seed: int = 0, scale: float = 0.5):
    """Non-identity adapter: give every value of the adapter a random non-zero number."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, SparseLayer) and adapter_name in module.sparse_values:
            values = module.sparse_values[adapter_name]
            with torch.no_grad():
                values.copy_((torch.rand(values.shape, generator=g) + 0.5) * scale * torch.sign(torch.randn(values.shape, generator=g)))


def sparse_layers(model):
    return [m for m in model.modules() if isinstance(m, SparseLayer)]


def record_full_passes(monkeypatch) -> list:
    """The layers whose forward took the full path (not a steady pass), in call order: the list fills
    as passes run (a full pass with an active adapter checks its adapters' tensors, ``check_ready``; a pass
    repeated from a memo does not)."""
    passes = []
    original = SparseLayer.check_ready
    monkeypatch.setattr(SparseLayer, "check_ready", lambda self, *a: passes.append(self) or original(self, *a))
    return passes


def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' 97 ids ("t0" … "t96"), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(97)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2")


def train_on(model, optimizer, scheduler, x, steps: int, after_step=None) -> list:
    """``steps`` training steps on the batch ``x`` (or ``x(step)`` where ``x`` is a function of the step; labels =
    inputs), the scheduler stepped after each optimizer step, then ``after_step(step)`` if given; returns the losses."""
    model.train()
    losses = []
    for step in range(steps):
        batch = x(step) if callable(x) else x
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def assert_backward_matches_reference(loss, model, reference, x) -> None:
    """Run the pending ``loss.backward()`` of ``model`` and a fresh pass of ``reference`` on ``x``
    (labels = inputs): the same loss and the same gradients of every sparse layer's values."""
    loss.backward()
    ref_loss = reference(x, labels=x).loss
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for a, b in zip(sparse_layers(model), sparse_layers(reference)):
        assert torch.equal(a.sparse_values["default"].grad, b.sparse_values["default"].grad)
