"""lorafuse.nn.layer_checkpoint on a stack of small torch layers: gradients equal the uncheckpointed stack's,
dropout included; extra tensor arguments get theirs; retain_graph, an input without gradient, torch.autograd.grad; a
forward without a backward keeps nothing."""
import gc

import pytest
import torch
from torch import nn

from lorafuse.nn.layer_checkpoint import LayerCheckpoint, _Stash


class Block(nn.Module):
    """x + W2 dropout(gelu(W1 x)) * gate: a residual block with dropout, and a second tensor input."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down, self.dropout = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.Dropout(0.4)

    def forward(self, x, gate):
        return x + self.down(self.dropout(nn.functional.gelu(self.up(x)))) * gate


def run(blocks, x, gate, checkpoint):
    # x: [B, T, W], gate: [W] -> the loss, after its backward
    for block in blocks:
        x = checkpoint(block, x, gate) if checkpoint else block(x, gate)
    loss = x.square().mean()
    loss.backward()
    return loss.detach()


def test_gradients_equal_the_uncheckpointed_stack():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(12) for _ in range(3)).train()
    x = torch.randn(2, 5, 12, requires_grad=True)
    gate = torch.rand(12, requires_grad=True)
    results = []
    for checkpoint in (None, LayerCheckpoint(), LayerCheckpoint(offload=True)):
        blocks.zero_grad(set_to_none=True)
        x.grad = gate.grad = None
        torch.manual_seed(7)  # the dropout masks
        loss = run(blocks, x, gate, checkpoint)
        results.append((loss, x.grad, gate.grad, [p.grad for p in blocks.parameters()]))
    (loss, dx, dgate, grads), *checkpointed = results
    assert dx is not None and dgate is not None and all(g is not None for g in grads)
    for loss_c, dx_c, dgate_c, grads_c in checkpointed:  # on the GPU, or offloaded (off CUDA: where it is)
        assert torch.equal(loss, loss_c)
        torch.testing.assert_close(dx_c, dx, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(dgate_c, dgate, rtol=1e-6, atol=1e-7)
        for got, want in zip(grads_c, grads):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_forward_without_backward_frees_its_stashes():
    blocks = nn.ModuleList(Block(8) for _ in range(3))
    checkpoint = LayerCheckpoint(offload=True)
    x = torch.randn(3, 8, requires_grad=True)
    out = x
    for block in blocks:
        out = checkpoint(block, out, torch.ones(8))
    del out
    gc.collect()
    assert not [obj for obj in gc.get_objects() if isinstance(obj, _Stash)]


def test_a_second_backward_with_retain_graph_adds_the_same_gradients_again():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(8) for _ in range(2)).train()
    x, gate = torch.randn(3, 8, requires_grad=True), torch.rand(8)
    grads = []
    for checkpoint in (None, LayerCheckpoint()):
        blocks.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        out = x
        for block in blocks:
            out = checkpoint(block, out, gate) if checkpoint else block(out, gate)
        loss = out.square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad.clone() for p in blocks.parameters()])
    for got, want in zip(*grads[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_parameters_get_gradients_when_the_input_needs_none():
    # frozen embeddings: the first layer's input does not require grad, its parameters still train
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(8) for _ in range(2)).train()
    x, gate = torch.randn(3, 8), torch.rand(8)
    grads = []
    for checkpoint in (None, LayerCheckpoint()):
        blocks.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        run(blocks, x, gate, checkpoint)
        grads.append([p.grad for p in blocks.parameters()])
    assert all(g is not None for g in grads[1])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_autograd_grad_is_refused_with_a_reason():
    block = Block(8)
    x = torch.randn(3, 8, requires_grad=True)
    loss = LayerCheckpoint()(block, x, torch.rand(8)).sum()
    with pytest.raises(RuntimeError, match=r"works with \.backward\(\), not torch\.autograd\.grad"):
        torch.autograd.grad(loss, [x])
