"""Which of a checkpoint's config values may change after it was written, marked on the schema
fields (their metadata), which rundir and evaluate read through config.schema.marked_keys()."""

# FREE_ON_RESUME: how a run goes, not what it computes, so a resume may change it.
# EVALUATE_SETS: evaluate may set it; the checkpoint's config decides the rest.
FREE_ON_RESUME = {"free_on_resume": True}
EVALUATE_SETS = {"evaluate_sets": True}
