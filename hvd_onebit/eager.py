"""The optimizer's entry points run eagerly inside a ``torch.compile``'d function (a graph
break there): a step, its gradient hooks and DDP's communication hook are bookkeeping,
collectives and kernels of their own, none of which Dynamo can trace. The decorator is
torch.optim's own lazy one where torch has it, so importing hvd_onebit does not import Dynamo;
``torch.compiler.disable`` otherwise."""
from __future__ import annotations

import torch

eager = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
