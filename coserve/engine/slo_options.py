"""The co-serving SLO options that ``coserve serve`` and ``coserve bench`` share (the latency targets, and the
knobs that trade finetuning and first tokens against them): one definition, one set of defaults (``EngineConfig``
fields of the same names)."""

from __future__ import annotations

from coserve.scheduler.config import DEFAULT_LOAD_RESERVE_S, DEFAULT_SLO_MARGIN, DEFAULT_SLO_MARGIN_MAX

# The EngineConfig fields these options set, named as the options' destinations.
SLO_FIELDS = ("slo_tpot_ms", "slo_margin", "slo_margin_max", "load_margin_max", "load_reserve_ms",
              "finetune_burst_ms", "first_token_slice_ms", "scheduler_delay_factor")


def add_slo_arguments(p, prefix: str = "") -> None:
    """Add the options to parser ``p``; ``prefix`` starts the help of those only one policy reads ("coserve: ")."""
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="the inference time-per-output-token SLO")
    p.add_argument("--slo-margin", type=float, default=DEFAULT_SLO_MARGIN,
                   help=f"{prefix}the least fraction of the TPOT SLO kept free when sizing finetuning slices")
    p.add_argument("--slo-margin-max", type=float, default=DEFAULT_SLO_MARGIN_MAX,
                   help=f"{prefix}the most: misses of the SLO and the inference load raise the margin toward it "
                        "(equal to --slo-margin: fixed)")
    p.add_argument("--load-margin-max", type=float, default=None,
                   help=f"{prefix}the most the inference load alone raises the margin to; above it only misses "
                        "of the SLO do (default: --slo-margin-max)")
    p.add_argument("--load-reserve-ms", type=float, default=DEFAULT_LOAD_RESERVE_S * 1000,
                   help=f"{prefix}the most TPOT slack the load margin makes a request bank; one that has banked it "
                        "goes at the target without the load margin (inf: the whole output; default: %(default)s)")
    p.add_argument("--finetune-burst-ms", type=float, default=None,
                   help=f"{prefix}with requests decoding, finetuning waits for TPOT slack banked for a slice this "
                        "long (0 = a slice in every iteration; default: 100 on a CPU, 0 on a GPU)")
    p.add_argument("--first-token-slice-ms", type=float, default=None,
                   help=f"{prefix}the most finetuning an iteration that gives a request its first token carries "
                        "(its time is banked as the running requests' TPOT slack; inf = as any other iteration; "
                        "default: 5 on a CPU, inf on a GPU)")
    p.add_argument("--scheduler-delay-factor", type=float, default=0.0,
                   help="while requests run, new prompts wait until the oldest has waited this many times the last "
                        "prompt iteration's latency, so that several share one prefill pass (vLLM's flag; 0 = off)")


def slo_settings(args) -> dict:
    """The parsed options as ``EngineConfig`` (and ``RunSpec``) keyword arguments."""
    return {name: getattr(args, name) for name in SLO_FIELDS}
