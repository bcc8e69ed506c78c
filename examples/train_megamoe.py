"""Embed MegaMoE in a plain PyTorch training loop, beside the same model with an eager MoE block.

MegaMoE is an ``nn.Module`` with ordinary Parameters (``gate_up``, ``down``); its forward and
backward run MegaMoE's task graphs on megaloom's thread executor, so the loop is the usual
zero_grad / forward / backward / step. The model: embed the tokens, route them (a linear
router, softmax, top-2), run the expert block with a residual, predict with a linear head.

    tokens --embed--> h --router: softmax, top-2--> ids, weights
                      |                                  |
                      +--> MegaMoE(h, ids, weights) <----+ --(+ h)--> head --> logits --> loss

    inside MegaMoE, per expert e:  gather (vector) --> GMM1 (cube) --> SwiGLU (vector)
                                   --> GMM2 (cube) --> weighted sum over the top-2 (vector)

The task: learn a fixed random map from each token to its target token. A twin model with
the eager MoE block (plain torch, autograd) starts from the same weights and sees the same
batches: the two loss curves agree step for step.

Run it: python examples/train_megamoe.py
"""
import torch
import torch.nn.functional as F
from torch import nn

from megaloom.graphs import MegaMoE, moe_reference

VOCAB, HIDDEN, INTER, EXPERTS, TOP_K = 64, 64, 64, 4, 2


class EagerMoE(nn.Module):
    """The same expert block in eager torch, with MegaMoE's parameter names and layout."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(EXPERTS, HIDDEN, 2 * INTER))
        self.down = nn.Parameter(torch.empty(EXPERTS, INTER, HIDDEN))

    def forward(self, x, ids, weights):
        return moe_reference(x, ids, weights, self.gate_up, self.down)


class TinyMoELM(nn.Module):
    def __init__(self, moe: nn.Module):
        super().__init__()
        self.embed, self.router, self.moe = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, EXPERTS), moe
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)                                       # [T, H]
        weights, ids = self.router(h).softmax(-1).topk(TOP_K)        # [T, k] each
        return self.head(h + self.moe(h, ids, weights))              # [T, VOCAB]


torch.manual_seed(0)
torch.set_num_threads(1)  # MegaMoE's engine workers are the parallelism on a CPU
model = TinyMoELM(MegaMoE(HIDDEN, INTER, EXPERTS, TOP_K, tile_m=32))
twin = TinyMoELM(EagerMoE())
twin.load_state_dict(model.state_dict())  # the same starting weights
print(model.moe, end="\n\n")

target_of = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
batches = torch.Generator().manual_seed(2)
optimisers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, twin)]
worst = 0.0
print("step   loss (MegaMoE)   loss (eager MoE)")
for step in range(1, 31):
    tokens = torch.randint(VOCAB, (128,), generator=batches)
    losses = []
    for m, opt in zip((model, twin), optimisers):
        opt.zero_grad()
        loss = F.cross_entropy(m(tokens), target_of[tokens])
        loss.backward()            # MegaMoE's backward graph gives d(hidden), d(weights), d(gate_up), d(down)
        opt.step()
        losses.append(loss.item())
    worst = max(worst, abs(losses[0] - losses[1]))
    if step % 5 == 0:
        print(f"{step:4d}   {losses[0]:14.4f}   {losses[1]:16.4f}")
print(f"\nthe two loss curves agree within 1e-4 at every step: {worst < 1e-4}")
