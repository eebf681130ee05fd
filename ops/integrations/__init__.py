"""Adapters that put the ops into third-party model code, in place.

Nothing is imported here: each adapter is its own module and imports its client library itself, so
``import ops`` never needs those libraries. ``ops.integrations.hf_deepseek_v4``: HF transformers'
DeepSeek-V4 hyper-connections (mHC pre with Sinkhorn, and the decoder layer's post) on ``ops.mhc_pre`` /
``ops.mhc_post``; docs/design/hf_deepseek_v4.md.
"""
