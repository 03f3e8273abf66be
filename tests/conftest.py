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
