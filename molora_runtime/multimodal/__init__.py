"""Multimodal vocabulary routing: 8x8 grey-level images as tokens of the base vocabulary.

`tokens` maps images to 16 codes of a small VQ codebook (`codebook`, k-means on 2x2 patches)
on one reserved block of SmolLM2's vocabulary, `digits` builds the `draw` / `read` / mixed
training and eval data from scikit-learn's digits, `png` turns images into PNG data URLs and back
for the HTTP API (a strict stdlib reader), `prompt` splices images into chat prompts.
"""
