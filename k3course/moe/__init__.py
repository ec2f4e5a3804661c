"""The MoE track (chapters 01–03): routing, balancing, sort-based dispatch, experts, MoE and LatentMoE."""

from k3course.moe.balancer import Balancer
from k3course.moe.balancing import (
                                    bias_from_histogram,
                                    expert_load,
                                    histogram_quantile_bias,
                                    margin_histogram,
                                    quantile_balance_bias,
                                    quantile_balance_bias_from_histograms,
                                    router_z_loss,
                                    sign_rule_update,
                                    switch_aux_loss,
                                    token_cutoffs,
)
from k3course.moe.dispatch import LocalDispatch, grouped_mm, sort_by_expert, unsort
from k3course.moe.experts import GLUFFN, RoutedExperts, situ_glu, swiglu
from k3course.moe.latent import all_to_all_bytes_per_token, latent_combine, moe_flops_per_token, rms_norm
from k3course.moe.layers import LatentMoE, MoE
from k3course.moe.router import Router
from k3course.moe.routing import router_scores, topk_route
from k3course.moe.stats import load_entropy, load_statistics, max_violation

__all__ = ["Balancer", "GLUFFN", "LatentMoE", "LocalDispatch", "MoE", "RoutedExperts", "Router",
           "all_to_all_bytes_per_token", "bias_from_histogram", "expert_load", "grouped_mm", "histogram_quantile_bias",
           "latent_combine", "load_entropy", "load_statistics", "margin_histogram", "max_violation",
           "moe_flops_per_token", "quantile_balance_bias", "quantile_balance_bias_from_histograms", "rms_norm",
           "router_scores", "router_z_loss", "sign_rule_update", "situ_glu", "sort_by_expert", "swiglu",
           "switch_aux_loss", "token_cutoffs", "topk_route", "unsort"]
