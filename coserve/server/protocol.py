"""Request bodies of the OpenAI API (and vLLM's extensions), validated strictly: a wrong type is a 400
naming the field, never coerced. Unknown fields are ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from coserve.finetune.graph_pruning import DEFAULT_MEMORY_TARGET

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
INT64 = (-2**63, 2**63 - 1)  # seeds: what a torch generator takes (the server adds the choice's index)


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def list_page(page: list[dict], has_more: bool) -> dict:
    """OpenAI's list object of one page of objects (``first_id`` / ``last_id`` for the next page's ``after``)."""
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


# OpenAI's metadata: at most 16 pairs, keys of up to 64 characters, values of up to 512
Metadata = dict[Annotated[str, StringConstraints(max_length=64)],
                Annotated[str, StringConstraints(max_length=512)]] | None


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's counts so far


class Sampling(Body):
    """The fields completions and chat completions share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    top_k: int = Field(-1, ge=-1)  # vLLM's extension
    repetition_penalty: float = Field(1.0, gt=0)  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    min_p: float = Field(0.0, ge=0, le=1)  # vLLM's extension
    min_tokens: int = Field(0, ge=0)  # vLLM's extension
    priority: int = Field(0, ge=INT64[0], le=INT64[1])  # vLLM's: lower first under --scheduling-policy priority
    stop_token_ids: list[int] | None = None  # vLLM's extension
    include_stop_str_in_output: bool = False  # vLLM's extension
    allowed_token_ids: list[int] | None = Field(None, min_length=1)  # vLLM's extension
    response_format: Any = None  # OpenAI's: text, json_object or json_schema (coserve/server/response_format.py)
    guided_json: Any = None  # vLLM's extension: a JSON schema (an object or its text) the output must match
    guided_choice: Any = None  # vLLM's extension: the output is exactly one of these strings
    structured_outputs: Any = None  # vLLM's newer form: {"json": ...}, {"choice": ...}, {"regex": ...}, {"grammar": ...}
    guided_regex: Any = None  # vLLM's extension: the whole output matches this regular expression
    guided_grammar: Any = None  # vLLM's extension: the whole output matches this GBNF or Lark grammar
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's extension: only the prompt's last k tokens
    skip_special_tokens: bool = True  # vLLM's extension: False writes special tokens into the text
    bad_words: list[str] | None = None  # vLLM's extension: words it may not write
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs name tokens "token_id:N"
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension: each prompt token's
    #   logprob and rank, and the top-N's, in vLLM's form (not streamed)


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # candidates per prompt, of which the n best return
    suffix: Any = None
    use_beam_search: bool = False  # vLLM's extension: n beams, the n best completions
    length_penalty: float = 1.0  # vLLM's extension (beam search): scores are logprob sums over length ** this


class TextPart(Body):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule


class FunctionDef(Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no parameters
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class GrammarSpec(Body):
    definition: str
    syntax: Literal["lark", "regex"]


class CustomFormat(Body):
    """A custom tool's input: free text, or text a grammar (Lark) or regular expression matches."""

    type: Literal["text", "grammar"]
    grammar: GrammarSpec | None = None


class CustomDef(Body):
    name: FunctionName
    description: str | None = None
    format: CustomFormat | None = None  # None: free text


class CustomTool(Body):
    """OpenAI's custom tool: called with one string (``input``), not JSON arguments."""

    type: Literal["custom"]
    custom: CustomDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class NamedCustomChoice(Body):
    type: Literal["custom"]
    custom: NamedFunction


class CalledFunction(Body):
    name: str
    arguments: str  # JSON text


class ToolCall(Body):
    id: str
    type: Literal["function"]
    function: CalledFunction


class CalledCustom(Body):
    name: str
    input: str


class CustomToolCall(Body):
    id: str
    type: Literal["custom"]
    custom: CalledCustom


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Annotated[ToolCall | CustomToolCall, Field(discriminator="type")]] | None = None  # past calls
    tool_call_id: str | None = None  # a tool message: the call it answers


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # OpenAI's


class ChatTemplateOptions(Body):
    """vLLM's controls over the chat template's rendering (``coserve/model/chat_prompt.py``), and OpenAI's
    ``reasoning_effort``, which the template receives as ``reasoning_effort`` (as vLLM passes it: gpt-oss's template
    reads it; one that does not ignores it) unless ``chat_template_kwargs`` names it."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning_effort`` where given."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


class ChatCompletionRequest(Sampling, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Annotated[Tool | CustomTool, Field(discriminator="type")]] | None = None  # coserve/server/tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | NamedCustomChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's extension: the reply begins with the last message where it is the assistant's
    include_reasoning: bool = True  # vLLM's extension: False leaves the reasoning (--reasoning-parser) out of the reply
    functions: Any = None
    function_call: Any = None
    store: bool | None = None  # OpenAI's: keep it for GET /v1/chat/completions (coserve/server/stored_chat.py)
    metadata: Metadata = None  # kept with a stored completion, to filter the listing by


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered with the model's chat template (and its
    options, as the chat API takes them)."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: as the completions API tokenizes it


class EmbeddingRequest(ChatTemplateOptions):
    """OpenAI's ``POST /v1/embeddings``, with vLLM's extensions: chat ``messages`` instead of ``input`` (rendered with
    the chat template, without a generation prompt unless asked), ``truncate_prompt_tokens``, ``normalize``,
    ``priority``."""

    model: str
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    add_generation_prompt: bool = False  # vLLM's default for embedding a conversation
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's extension: only the prompt's last k tokens
    normalize: bool = True  # vLLM's extension: False returns the hidden state as it is
    priority: int = Field(0, ge=INT64[0], le=INT64[1])  # vLLM's: lower first under --scheduling-policy priority


class ScoreRequest(Body):
    """vLLM's ``POST /score``: the similarity of each pair of ``text_1`` and ``text_2`` (one with many, or pairwise)."""

    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = Field(0, ge=INT64[0], le=INT64[1])


class RerankRequest(Body):
    """vLLM's (and Jina's and Cohere's) ``POST /rerank``: ``documents`` ranked by their similarity to ``query``."""

    model: str
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int = Field(0, ge=0)  # the best this many; 0 = all (vLLM's default)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = Field(0, ge=INT64[0], le=INT64[1])


class DetokenizeRequest(Body):
    model: str
    tokens: list[int]


class LoadLoraRequest(Body):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(Body):
    lora_name: str = Field(min_length=1)


class Hyperparameters(Body):
    n_epochs: int | Literal["auto"] = "auto"
    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"


class Supervised(Body):
    hyperparameters: Hyperparameters | None = None


class DpoHyperparameters(Hyperparameters):
    beta: float | Literal["auto"] = "auto"


class Dpo(Body):
    hyperparameters: DpoHyperparameters | None = None


class ReinforcementHyperparameters(Hyperparameters):
    compute_multiplier: float | Literal["auto"] = "auto"  # scales the completions sampled per prompt
    eval_interval: int | Literal["auto"] = "auto"  # steps between evaluations on the validation file
    eval_samples: int | Literal["auto"] = "auto"  # completions per validation prompt
    reasoning_effort: str = "default"  # for reasoning models; coserve's models take only "default"


class Reinforcement(Body):
    grader: dict[str, Any]  # checked by coserve/finetune/graders.py (errors name method.reinforcement.grader.*)
    hyperparameters: ReinforcementHyperparameters | None = None
    response_format: Any = None  # OpenAI's: the completions' JSON schema (graders read sample.output_json)


class Method(Body):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: Supervised | None = None
    dpo: Dpo | None = None  # OpenAI's Direct Preference Optimization: the training file holds preference pairs
    # OpenAI's reinforcement fine-tuning: the training file holds prompts, a grader scores sampled completions (GRPO)
    reinforcement: Reinforcement | None = None


class CoserveOptions(Body):
    """coserve's extension of a fine-tuning job (send it with the openai client's ``extra_body``)."""

    peft: Literal["lora", "ia3"] = "lora"
    r: int = Field(16, ge=1, le=256)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    use_rslora: bool = False
    use_dora: bool = False
    target_modules: list[str] | None = None
    target_parameters: list[str] | None = None  # a mixture's experts (LoRA), PEFT's: experts.gate_up_proj, ...
    max_seq_len: int | None = Field(None, ge=2)  # None = min(1024, the server's context)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr_scheduler: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    grad_accum: int = Field(1, ge=1)
    max_steps: int = Field(0, ge=0)
    eval_steps: int = Field(10, ge=0)  # with a validation_file: a validation batch every this many steps (0 = off)
    # what a sequence keeps between its forward and backward passes, as ``coserve finetune`` takes them: more kept,
    # less recomputed (faster, more memory)
    rematerialize: Literal["cheap", "all"] = "cheap"
    memory_target: float = Field(DEFAULT_MEMORY_TARGET, gt=0, le=1)
    # a DPO job's loss (TRL's loss_type), or one of the reference-free preference methods in its place: simpo (TRL's
    # CPOTrainer, loss_type simpo) or orpo (TRL's ORPOTrainer), with method.dpo.hyperparameters.beta as their beta
    dpo_loss: Literal["sigmoid", "hinge", "ipo", "simpo", "orpo"] = "sigmoid"
    dpo_label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # a DPO job's, with the sigmoid or the simpo loss
    simpo_gamma: float = Field(0.5, ge=0)  # SimPO's target reward margin
    # a reinforcement job's GRPO (TRL's names): completions per prompt (before method's compute_multiplier), their
    # length, sampling temperature, loss and advantage scaling
    num_generations: int = Field(8, ge=2, le=64)
    max_completion_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0, le=2)
    grpo_loss: Literal["dapo", "grpo", "bnpo", "dr_grpo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"


class PermissionRequest(Body):
    """``POST /v1/fine_tuning/checkpoints/{model}/permissions``: the tenants (OpenAI's projects) to share it with."""

    project_ids: list[str] = Field(max_length=100)


class FineTuningJobRequest(Body):
    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = Field(None, max_length=16)  # OpenAI's
    coserve: CoserveOptions | None = None


class BatchRequest(Body):
    """OpenAI's ``POST /v1/batches`` (coserve/server/batches_api.py)."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = Field(None, max_length=16)


# ---- OpenAI's Responses API (coserve/server/responses_api.py) ----------------------------------------------
class ContentText(Body):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentText]


class CallItem(Body):
    """What every call item and call-result item of the input carries."""

    call_id: str
    id: str | None = None
    status: str | None = None


class FunctionCallInput(CallItem):
    """A call the model made earlier in the conversation."""

    type: Literal["function_call"]
    name: str
    arguments: str


class FunctionCallOutputInput(CallItem):
    """A call's result, sent back to the model."""

    type: Literal["function_call_output"]
    output: str


class TextFormat(Body):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(Body):
    format: TextFormat | None = None


class FunctionTool(Body):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesCustomFormat(Body):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class ResponsesCustomTool(Body):
    type: Literal["custom"]
    name: FunctionName
    description: str | None = None
    format: ResponsesCustomFormat | None = None


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class CustomChoice(Body):
    type: Literal["custom"]
    name: str


class CustomToolCallInput(CallItem):
    """A custom tool call the model made earlier in the conversation."""

    type: Literal["custom_tool_call"]
    name: str
    input: str


class CustomToolCallOutputInput(CallItem):
    """A custom tool call's result, sent back to the model."""

    type: Literal["custom_tool_call_output"]
    output: str


class ReasoningInput(Body):
    """A reasoning item of an earlier response, given back with the conversation (a client that keeps it by
    appending each response's ``output`` to its next ``input``); read and dropped, as Qwen3's and DeepSeek-R1's chat
    templates drop the reasoning of earlier turns."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class ConversationRef(Body):
    id: str


class ReasoningOptions(Body):
    """The Responses API's ``reasoning``: ``effort`` as chat's ``reasoning_effort``; ``summary`` kept (coserve writes
    no summaries of reasoning)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Body):
    model: str
    input: str | list[InputMessage | FunctionCallInput | FunctionCallOutputInput | CustomToolCallInput
                      | CustomToolCallOutputInput | ReasoningInput]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextOptions | None = None
    tools: list[Annotated[FunctionTool | ResponsesCustomTool, Field(discriminator="type")]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | CustomChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOptions | None = None  # its effort goes to the chat template (ChatTemplateOptions) and is kept
    conversation: str | ConversationRef | None = None  # OpenAI's Conversations API (conversations_api.py)
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest messages dropped to fit the context
    store: bool | None = None
    background: bool = False  # OpenAI's: return at once, queued; poll GET (coserve/server/background_responses.py)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None  # "message.output_text.logprobs": the reply text's token logprobs
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])  # vLLM's extension


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: a Responses request whose prompt is counted, its model optional."""

    model: str | None = None
