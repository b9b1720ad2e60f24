"""What both halves read: the plan, its choices and terms, the model's trace and layer description,
the style rules, rows, halos, groups and hand-off geometry, the zoo, the cluster description, the
configuration machinery, the optimizer and the timing helpers. It imports neither half."""
