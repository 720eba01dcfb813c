"""``fast_moe``, routers: the top-k router of Mixtral and Qwen3-MoE runs foak's routing kernel
(foak.ops.moe_router.moe_route) after its own logits GEMM.

transformers' routers (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``) compute ``logits = x W^T`` and then
five to eight small kernels each way on ``[tokens, experts]`` (fp32 cast, softmax, top-k, sum, divide, cast);
the replacement forward keeps the GEMM (``F.linear``, autocast as before) and does the rest in one Triton
kernel forward and one backward, returning what the router returns — ``(logits, weights, indices)``, the
weights fp32 (Mixtral) or in the logits' dtype (Qwen3-MoE) — so the auxiliary load-balancing loss, which
reads the logits, is transformers' own. GraniteMoE's router is left alone: the order of its outputs changed
between transformers 5.x releases.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from foak.ops.moe_router import moe_route
from foak.patching.rules import Rule, Skip, Trigger

# router class -> (attribute holding "renormalise the top-k weights", or None for always; cast the weights to
# the logits' dtype)
ROUTERS = {
    "MixtralTopKRouter": (None, False),
    "Qwen3MoeTopKRouter": ("norm_topk_prob", True),
}


class _NoRouterClass(nn.Module):
    """Trigger class where the installed transformers has no such router class (the rule is skipped)."""


def moe_router_rule(arch: str, modeling, router_class_name: str) -> Rule:
    router_class = getattr(modeling, router_class_name, None)
    renorm_attribute, cast = ROUTERS[router_class_name]

    def skip_reason(model):
        if router_class is None:
            return f"{modeling.__name__} has no {router_class_name}"
        return None

    def patch(module, model, state):
        weight = getattr(module, "weight", None)
        top_k, hidden_dim = getattr(module, "top_k", None), getattr(module, "hidden_dim", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or not isinstance(top_k, int) \
                or weight.shape[1] != hidden_dim or not 1 <= top_k <= weight.shape[0]:
            return Skip(f"{router_class_name} without the weight [experts, hidden] / top_k / hidden_dim it has in "
                        "transformers 5.x")
        if "forward" in vars(module):
            return Skip("its forward is replaced on the instance")

        def forward(hidden_states):
            logits = F.linear(hidden_states.reshape(-1, module.hidden_dim), module.weight)
            renormalize = True if renorm_attribute is None else bool(getattr(module, renorm_attribute))
            weights, indices = moe_route(logits, module.top_k, renormalize)
            return logits, (weights.to(logits.dtype) if cast else weights), indices

        return forward

    return Rule(f"{arch}.moe_router", "moe", Trigger(router_class or _NoRouterClass), patch, skip_reason)
