import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch and starts from a known seed."""
    import dmfx

    torch._dynamo.reset()
    dmfx.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||a - b|| / ||b|| (or / ||scale||): the project's way to compare with eager."""
    a, b = a.detach().double(), b.detach().double()
    denom = (scale.detach().double() if scale is not None else b).norm().item()
    return (a - b).norm().item() / max(denom, 1e-30)


def tiny_bert_layer():
    """An HF BertLayer (hidden 32, 4 heads, eager attention, dropout off) in train mode, and a copy."""
    import copy

    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = transformers.models.bert.modeling_bert.BertLayer(cfg).train()
    return layer, copy.deepcopy(layer)
