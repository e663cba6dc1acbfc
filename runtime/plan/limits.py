"""Bounds on transient tensors that the plan budgets for and the model and generation keep to: one place, so the
planner needs nothing from the modules that allocate them."""

# attention scores held at once (256 MiB in fp32): long prompts attend in query chunks
SCORE_ELEMENTS = 1 << 26
# positions whose logits exist at once (one while sampling, up to this many in Engine.logits)
LOGIT_ROWS = 16
# after drafting falls back, MTP cache entries are computed this many at a time
MTP_BATCH = 16
# expert slots a plan that keeps backbone in RAM leaves on the device, in one token's experts: one layer's computing
# while the next layer's are copied in
PLANNED_WAVES = 2
# --max-batch 0 (serve, run --batch): a batch's caches take at most this share of the device budget; what is left
# holds the expert slots, which the union of a batch's experts needs more than one sequence does
BATCH_KV_SHARE = 1 / 8
