"""The "About these numbers" text of the report: every derived quantity, defined once.

Kept next to, and worded after, the docstrings of :mod:`reports.scores`, :mod:`reports.seesaw`,
:mod:`reports.pareto`, :mod:`reports.routing` and :mod:`reports.paired`.
"""

from __future__ import annotations

ABOUT: tuple[tuple[str, str], ...] = (
    (
        "Primary metric",
        "Each task's first declared metric (e.g. acc before acc_norm). Seesaw, win rates and the "
        "Pareto analysis use it; the per-task drill-down shows every metric.",
    ),
    (
        "Relative score (retention)",
        "Direction-aware ratio to the full model on the same task: subnet / full when higher is better, "
        "full / subnet when lower is better (bits per byte, WER). 100% = as good as the full model, "
        "below 100% = worse, above = better; the heatmap shows it as a change, (ratio - 1) x 100%. A ratio "
        "is what the paper's elastic tables are read with (ES25%: 74.43 / 75.55 = 98.5%) and it keeps "
        "metrics on different scales comparable. A task the full model scores 0 on (higher is better) has "
        "no retention signal and is n/a, left out of every aggregate, as is any ratio with a 0 denominator "
        "or a negative value; two perfect 0 scores on a lower-is-better metric count as 100%.",
    ),
    (
        "Chance-normalised retention (with a random baseline)",
        "When the run also evaluated a random-initialised twin of the checkpoint (the 'random' baseline; "
        "not a subnet, shown only as the chance level), retention is measured on the margin above it: "
        "(sub - random) / (full - random), direction-aware (for lower-is-better metrics the signs of "
        "numerator and denominator both flip, so the formula is the same). 100% = the full model's margin "
        "kept, 0% = no better than random. Without it, a task answered at chance by the full model shows "
        "~100% 'retention' at every subnet and props up its modality. Undefined when the full model is not "
        "above random. Its stderr: delta method with the three stderrs independent (conservative). Where "
        "the random model has no score on a task (older runs, or a unit it skipped), the plain ratio above "
        "is used. The report says which retention it uses.",
    ),
    (
        "Tasks at chance",
        "A task is above chance when the full model's margin over random, sign x (full - random), exceeds "
        "1.96 x sqrt(full stderr^2 + random stderr^2). A missing stderr cannot establish the margin, so "
        "such a task counts as at chance. Tasks at chance are listed with the margin and its 95% interval "
        "and left out of every modality and capability average, the seesaw index, the degradation order and "
        "the aggregate score; their per-task scores are still shown.",
    ),
    (
        "Uncertainty of a relative score",
        "Delta method on the ratio with both stderrs treated as independent. Both models score the same "
        "examples, so the errors are positively correlated and the interval is conservative (too wide).",
    ),
    (
        "Modality / capability score and its 95% interval",
        "The mean relative score over the tasks of a modality (text, image, video, audio) or capability "
        "(understanding, generation). Interval: mean +- 1.96 x sqrt(sum of squared task stderrs) / k over "
        "its k tasks, i.e. the sampling noise of this fixed set of tasks, not the spread between tasks "
        "(a bootstrap over two or three tasks would say little). n/a when a stderr is missing.",
    ),
    (
        "Seesaw index",
        "For one subnet, the spread (max - min) of its per-modality scores, in points of retention. 0 means "
        "all modalities kept the same share of their full-model score; 10 pts means the best-kept modality "
        "kept 10 points more than the worst-kept one. Large values mean shrinking the model trades one "
        "modality against another. Needs two or more modalities.",
    ),
    (
        "Which modality degrades first",
        "Subnets are walked from most to fewest active parameters (when efficiency was not recorded: the "
        "full model first, then by mean score). A modality crosses at the first subnet where its score "
        "falls below 95% retention; the modality that crosses at the most active parameters degrades first "
        "(ties: lower score first). Modalities that never cross come last, ordered by their score at the "
        "smallest subnet.",
    ),
    (
        "Aggregate score",
        "Mean of a subnet's per-modality scores, so every modality weighs the same however many tasks it "
        "has. Used as the y-axis of the efficiency plots.",
    ),
    (
        "Mean win rate (HELM)",
        "Per task, the share of the other subnets a subnet beats on the primary metric (ties count one "
        "half), averaged over the tasks the subnet has a score on, leaving out tasks at chance. "
        "Scale-free and robust to one outlying task; 1.0 = best on every task.",
    ),
    (
        "Pareto frontier",
        "For each cost (active params, total params, decode ms per token, FLOPs per token): the subnets "
        "that no other subnet beats on both axes, i.e. none has at least the aggregate score at no more "
        "cost while being strictly better in one. A subnet off the frontier is never the right choice.",
    ),
    (
        "Operating points",
        "ES: the subnet that only reduces top-k, with top-k closest to 25% of the full top-k (the paper's "
        "ES25.0%). EA: the best-scoring subnet that reduces depth, width and top-k together (the paper's "
        "EA35.8%). Speedup is measured decode tokens/s over the full model's; parameter shares are of the "
        "full model's.",
    ),
    (
        "Measured speed and failed measurements",
        "Prefill: median time of the prefill forward alone over the suite's prompt; decode: one over the "
        "median time of one greedy decoding step with the KV cache, each step timed on its own; brackets "
        "give the interquartile range over the repeats. A timing is a failed measurement, shown as "
        "'measurement failed' and left out of every speedup and decode-latency frontier, when it is not "
        "finite or not positive, when it implies more FLOP/s than a small multiple of the machine's "
        "measured matmul peak, or when its interquartile range spans so wide a factor that the median "
        "means nothing.",
    ),
    (
        "Normalised routing entropy",
        "NE = -sum_i p_i log p_i / log N, p_i the share of a group's routed tokens sent to expert i in a "
        "layer, N the number of routed experts. 1 = tokens spread evenly over all experts, 0 = a single "
        "expert takes every token.",
    ),
    (
        "IoU of the top-25% experts",
        "For two tasks or modalities in one layer: take each one's ceil(N / 4) most activated experts and "
        "divide the size of the intersection by that of the union. 1 = the same experts, 0 = disjoint "
        "experts (modality-specialised routing).",
    ),
)

COMPARE_ABOUT: tuple[tuple[str, str], ...] = (
    (
        "Pairing",
        "Examples are aligned by id; a cell is tested on the examples both runs scored. Without aligned "
        "samples a z-test on the two stderrs is used instead (method 'z (unpaired)').",
    ),
    (
        "Tests",
        "0/1 metrics (acc, exact_match): McNemar's test on the discordant pairs; other metrics: paired "
        "bootstrap of the mean difference (10,000 resamples); corpus metrics (bits per byte): paired "
        "bootstrap of the corpus value. Intervals are 95% paired-bootstrap percentile intervals.",
    ),
    (
        "Significance",
        "p-values are Holm-adjusted over every compared cell, so the chance of any false alarm in a night "
        "stays at 5%. A cell is a regression when its adjusted p < 0.05 and it moved in the metric's worse "
        "direction. A unit that was ok in the base run and failed with an error in the new run counts as a "
        "regression too; a unit skipped in the new run is reported as missing but does not gate.",
    ),
)
