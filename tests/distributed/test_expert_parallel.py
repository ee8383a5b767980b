"""Expert parallel on one MoE layer (2 gloo ranks): the all-to-all dispatch gives each token the
same output as one process, and the expert gradients (after the 1/ep hook) equal one process's
gradient of the global mean (docs/parallelisms.md, "Expert parallel")."""

from __future__ import annotations

import torch

from tests.launcher import run_ranks
from torchtitan.models.common.moe import MoE, MoEArgs

DIM = 16
ARGS = MoEArgs(num_experts=4, top_k=2, expert_dim=8, num_shared_experts=1)


def _layer() -> MoE:
    torch.manual_seed(0)
    layer = MoE(DIM, ARGS)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def _batch() -> torch.Tensor:
    return torch.randn(4, 6, DIM, generator=torch.Generator().manual_seed(1))


def _ep_rank() -> tuple[list, dict[str, list]]:
    """This rank's outputs and the full expert gradients, as lists (tensors sent through the
    result queue would share memory with a process that exits)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.expert_parallel import apply_ep

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    layer = _layer()
    apply_ep(layer, mesh)
    x = _batch()[2 * rank : 2 * rank + 2]  # each rank half of the sequences
    out = layer(x)
    out.square().mean().backward()
    grads = {n: p.grad.full_tensor().tolist() for n, p in layer.experts.named_parameters()}
    return out.detach().tolist(), grads


def test_ep2_matches_one_process() -> None:
    layer = _layer()
    x = _batch()
    ref = layer(x)
    # Data parallel averages the two ranks' gradients: the reference is the mean of their means.
    (0.5 * ref[:2].square().mean() + 0.5 * ref[2:].square().mean()).backward()
    results = run_ranks(_ep_rank, 2)
    got = torch.cat([torch.tensor(r[0]) for r in results])
    diff = (got - ref.detach()).abs().max().item()
    gdiff = max(
        (torch.tensor(results[0][1][n]) - p.grad).abs().max().item()
        for n, p in layer.experts.named_parameters()
    )
    print(f"EP 2 vs one process: outputs {diff:.1e}, expert gradients {gdiff:.1e}")
    assert diff <= 1e-6 and gdiff <= 1e-6
