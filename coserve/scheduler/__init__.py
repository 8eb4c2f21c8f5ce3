"""Request state and iteration planning: plain Python, no tensors."""

from coserve.scheduler.config import SchedulerConfig
from coserve.scheduler.plan import ExecutionResult, InferenceChunk, IterationPlan, TokenLogprobs
from coserve.scheduler.pooling_params import PoolingParams
from coserve.scheduler.request import Request, RequestStatus
from coserve.scheduler.sampling_params import SamplingParams
from coserve.scheduler.scheduler import Scheduler, TokenEvent

__all__ = ["ExecutionResult", "InferenceChunk", "IterationPlan", "PoolingParams", "Request", "RequestStatus",
           "SamplingParams", "Scheduler", "SchedulerConfig", "TokenEvent", "TokenLogprobs"]
