"""A small deterministic model and a couple of real AdamW steps on it (PyTorch 1.13, CPU, fp32).

The model is built to exercise every corner the sharded layouts have:
  * uneven parameter sizes (3, 5, 7, 13 ... elements) so every flat group and partition needs padding;
  * a tied parameter (``head.weight`` is ``embed.weight``);
  * frozen parameters (``frozen.*``, requires_grad=False);
  * BatchNorm buffers (``running_mean``/``running_var`` float, ``num_batches_tracked`` int64), a
    persistent float buffer and a non-persistent buffer (which no checkpoint stores);
  * nested sub-modules so FSDP units have prefixes.

Training runs in fp32 on the per-parameter AdamW of torch 1.13.  AdamW is element-wise, so the moments
of a flat partition that DeepSpeed or FSDP would hold are exactly slices of these per-parameter
moments (padding elements see zero gradients and stay zero).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 13
DIM = 6


class Block(nn.Module):
    def __init__(self, d_in, d_out, norm):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.BatchNorm1d(d_out) if norm else None

    def forward(self, x):
        x = self.lin(x)
        if self.norm is not None:
            x = self.norm(x)
        return torch.relu(x)


class Tiny(nn.Module):
    """A parameter of 3 elements in its own module: with 4 or 8 ranks some shards get nothing."""

    def __init__(self):
        super().__init__()
        self.layer_scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x[:, :3] * self.layer_scale


class TinyNet(nn.Module):
    def __init__(self, with_frozen=True, with_bn=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block0 = Block(DIM, 10, norm=with_bn)
        self.block1 = Block(10, 7, norm=False)
        self.tiny = Tiny()
        self.back = nn.Linear(7, DIM)
        self.frozen = nn.Linear(7, 5) if with_frozen else None
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two names
        self.register_buffer("out_scale", torch.tensor([1.0, 0.5, 0.25]))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)
        if self.frozen is not None:
            for p in self.frozen.parameters():
                p.requires_grad_(False)

    def forward(self, tokens):
        h = self.embed(tokens).mean(1)
        a = self.block0(h)
        b = self.block1(a)
        h2 = h + self.back(b)
        logits = self.head(h2)
        extra = self.tiny(b) * self.out_scale
        loss_extra = extra.pow(2).mean()
        if self.frozen is not None:
            loss_extra = loss_extra + self.frozen(b).pow(2).mean() * 0.1
        return logits, loss_extra


def build_model(seed=1234, with_frozen=True, with_bn=True):
    torch.manual_seed(seed)
    model = TinyNet(with_frozen=with_frozen, with_bn=with_bn)
    # Make every value distinctive (no accidental zeros/ones that would hide an off-by-one).
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def default_group_spec(model):
    """Four param groups, like a real recipe: decayed matrices, non-decayed vectors, the embedding, and
    a group holding only the 3-element ``tiny.layer_scale``.

    Returns a list of (list_of_names, hyperparams).  Names come from ``named_parameters()`` (which
    lists a tied parameter once, under its first name).  Frozen parameters are passed to the optimizer
    too, as most training scripts do; ZeRO drops them from its flat groups.
    """
    matrices, vectors, embed, scales = [], [], [], []
    for name, p in model.named_parameters():
        if name == "embed.weight":
            embed.append(name)
        elif name == "tiny.layer_scale":
            scales.append(name)
        elif p.dim() >= 2:
            matrices.append(name)
        else:
            vectors.append(name)
    return [
        (matrices, {"lr": 1e-2, "weight_decay": 0.1}),
        (vectors, {"lr": 2e-2, "weight_decay": 0.0}),
        (embed, {"lr": 5e-3, "weight_decay": 0.01}),
        # 3 elements alone: with 8 ranks, most ranks' partitions of this group are pure padding.
        (scales, {"lr": 1e-3, "weight_decay": 0.0}),
    ]


def single_group_spec(model):
    return [([n for n, _ in model.named_parameters()], {"lr": 1e-2, "weight_decay": 0.05})]


def train(model, group_spec, steps=2, batch=8, seed=99, extra_group_keys=None):
    """Run ``steps`` real AdamW steps; returns the torch.optim.AdamW instance.

    ``extra_group_keys(i, names)`` may add keys (e.g. OLMo's ``param_names``) to each param group.
    """
    named = dict(model.named_parameters())
    groups = []
    for i, (names, hp) in enumerate(group_spec):
        g = {"params": [named[n] for n in names]}
        g.update(hp)
        if extra_group_keys is not None:
            g.update(extra_group_keys(i, names))
        groups.append(g)
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, 5), generator=gen)
        target = torch.randint(0, VOCAB, (batch,), generator=gen)
        logits, extra = model(tokens)
        loss = F.cross_entropy(logits, target) + extra
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return opt


def param_state(opt, param):
    """The per-parameter AdamW state (step, exp_avg, exp_avg_sq) or None for a parameter without one."""
    return opt.state.get(param)
