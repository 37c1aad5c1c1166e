"""Draft heads, the frozen-target adapter and the head format."""

from .config import HeadConfig, TargetIdentity, default_fused_layer_ids
from .head import DraftHead, HeadOutput
from .layers import HeadCache
from .target import Target, TargetOutput

__all__ = ["DraftHead", "HeadCache", "HeadConfig", "HeadOutput", "Target", "TargetIdentity", "TargetOutput",
           "default_fused_layer_ids"]
