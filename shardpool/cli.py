"""The ``shardpool`` command: argument parsing, and turning known errors into one line.

Heavy modules (torch, transformers) are imported inside the command that needs them, so
``shardpool mesh ...`` and ``--help`` stay fast and never load torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mesh.errors import MeshError
from shardpool import __version__
from shardpool.agent.accounts import DEFAULT_LAUNCH_GROUP, DEFAULT_RUN_AS
from shardpool.errors import ShardpoolError

if TYPE_CHECKING:
    from shardpool.console import RunEvents

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with one sub-command per user action."""
    from mesh.constants import AGENT_PORT

    parser = argparse.ArgumentParser(
        prog="shardpool",
        description="QLoRA fine-tuning across mismatched devices over a WireGuard mesh.",
    )
    parser.add_argument("--version", action="version", version=f"shardpool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    finetune = commands.add_parser("finetune", help="train a LoRA adapter from an axolotl-style config")
    finetune.add_argument("config", help="path to the YAML config")
    finetune.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    finetune.add_argument(
        "--json",
        action="store_true",
        help="print the run's events (plan, step, eval, checkpoint, done, error) as JSON lines on "
        "stdout; everything else goes to stderr",
    )
    finetune.add_argument(
        "--state-dir",
        metavar="DIR",
        help="with `placement: mesh`: the mesh state directory given to `mesh init/join` "
        "(launch through the agent of that mesh; default: $SHARDPOOL_AGENT_SOCKET or the system agent)",
    )
    finetune.set_defaults(handler=_run_finetune)

    validate = commands.add_parser(
        "validate",
        help="check a config, its model and its data as finetune would, without loading torch",
        description=(
            "Check the config, the base model's config.json and tokenizer, and every dataset row, "
            "as `shardpool finetune` does before it starts, without loading torch or the weights. "
            "Prints the rows, tokens per row and how many rows sequence_len truncates (with `rl`: "
            "the pairs, and the rows left out); exits 0 "
            "when the run would start, 2 with the problems otherwise. Nothing is trained or written."
        ),
    )
    validate.add_argument("config", help="path to the YAML config")
    validate.add_argument(
        "--show",
        metavar="N",
        help="also print the first N rows of each dataset as the model sees them: the text with the "
        "trained part in green on a terminal, between ⟦ and ⟧ otherwise, and the token counts "
        "(with `rl`: the first N pairs, each as its chosen then its rejected sequence)",
    )
    validate.add_argument(
        "--json",
        action="store_true",
        help='with --show: print the rows as JSON lines {"dataset", "row", "text", "trained": '
        '[[start, end], ...], "tokens"} (trained: character spans of text; a pair\'s sequences add "pair": '
        '"chosen" or "rejected") on stdout; the report goes to stderr',
    )
    validate.set_defaults(handler=_run_validate)

    schema = commands.add_parser(
        "schema",
        help="print the config's JSON Schema (draft 2020-12) for editors",
        description=(
            "Print the JSON Schema of a config file: every shardpool key and every axolotl key "
            "shardpool accepts, with types and descriptions. Point an editor's YAML support at it, "
            "e.g. `shardpool schema > shardpool.schema.json`."
        ),
    )
    schema.set_defaults(handler=_run_schema)

    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a model (a finetune output, a config or a model directory), on local stages",
        description=(
            "Continue a prompt with the base model and its trained adapter, the adapter applied unmerged "
            "on NF4 stages as in training; greedy by default. Prints the completion on stdout."
        ),
    )
    generate.add_argument("target", help="a finetune output_dir, a YAML config, or a base model directory")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE (- for stdin)")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the tokenizer's chat template",
    )
    generate.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="at most N new tokens (default 64)"
    )
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default) is greedy; above 0 samples"
    )
    generate.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the most likely tokens up to this probability (default 1: off)",
    )
    generate.add_argument(
        "--top-k", type=int, default=0, help="sample among the K most likely tokens (default 0: off)"
    )
    generate.add_argument(
        "--seed", type=int, default=None, help="the seed of sampling: the same seed gives the same completion"
    )
    generate.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the completion before TEXT (repeatable)",
    )
    generate.add_argument(
        "--stages",
        type=int,
        default=None,
        metavar="N",
        help="pipeline stages, each a process with its share of the layers (default: 1 locally, one per device on the mesh)",
    )
    generate.add_argument(
        "--placement",
        choices=("local", "mesh"),
        default="local",
        help="run the stages on this machine (default) or on the mesh members online, through this machine's agent",
    )
    generate.add_argument(
        "--devices",
        default=None,
        metavar="LIST",
        help="cpu, cuda:0, ... : one device for all stages, or one per stage (default cpu; under torchrun, one GPU per stage where CUDA is present)",
    )
    generate.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object {"text", "token_ids", "finish_reason", ...} instead of the text',
    )
    generate.set_defaults(handler=_run_generate)

    merge = commands.add_parser(
        "merge", help="fold a trained adapter into its base model and save a plain Hugging Face model"
    )
    merge.add_argument("output_dir", help="a finetune output_dir (the adapter and its tokenizer)")
    merge.add_argument("--out", required=True, help="a new directory for the merged model")
    merge.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="dtype of the merged weights (default bf16)",
    )
    merge.set_defaults(handler=_run_merge)

    serve = commands.add_parser(
        "serve",
        help="serve a model (a finetune output, a config or a model directory) over an OpenAI-compatible API",
        description=(
            "Start the model's stages on this machine and answer OpenAI's /v1/models, /v1/completions "
            "and /v1/chat/completions (streamed or whole) until SIGINT or SIGTERM."
        ),
    )
    serve.add_argument("target", help="a finetune output_dir, a YAML config, or a base model directory")
    serve.add_argument("--host", default="127.0.0.1", help="the IP address to listen on (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=8000, help="the TCP port (default 8000; 0 picks a free one)"
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="answer only requests with `Authorization: Bearer KEY` (default: $SHARDPOOL_API_KEY, which, unlike a command line, other local users cannot read in `ps`; neither: no key is asked)",
    )
    serve.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages the layers are split into (default: 1 locally, one per device on the mesh)",
    )
    serve.add_argument(
        "--placement",
        choices=("local", "mesh"),
        default="local",
        help="run the stages on this machine (default) or on the mesh members online, through this machine's agent; "
        "a lost member's requests fail and the stages are placed again over the members left",
    )
    serve.add_argument(
        "--devices",
        default=None,
        help="one device for every stage, or one per stage: cpu,cuda:0,... (default cpu; under torchrun, one GPU per stage where CUDA is present)",
    )
    serve.add_argument(
        "--max-concurrent",
        type=int,
        default=8,
        help="requests generated at once (default 8); more wait in a queue",
    )
    serve.add_argument(
        "--max-queued",
        type=int,
        default=32,
        help="requests waiting for a slot (default 32); more are answered 429",
    )
    serve.add_argument(
        "--max-context",
        type=int,
        default=4096,
        help="tokens of one request, prompt and completion (default 4096)",
    )
    serve.add_argument(
        "--chat-max-tokens",
        type=int,
        default=1024,
        help="the max_tokens of a chat request that gives none: the rest of the context, at most this (default 1024)",
    )
    serve.set_defaults(handler=_run_serve)

    jobs = commands.add_parser(
        "jobs", help="list, show or stop jobs started through this machine's agent (yours; root: all)"
    )
    jobs.add_argument("action", nargs="?", choices=("list", "show", "stop"), help="default: list")
    jobs.add_argument("job_id", nargs="?", metavar="ID", help="the job to show or stop")
    jobs_agent = jobs.add_mutually_exclusive_group()
    jobs_agent.add_argument(
        "--socket",
        help="the local agent's socket (default $SHARDPOOL_AGENT_SOCKET or /run/shardpool/agent.sock)",
    )
    jobs_agent.add_argument(
        "--state-dir",
        metavar="DIR",
        help="the mesh state directory given to `mesh init/join`: ask the agent of that mesh",
    )
    jobs.set_defaults(handler=_run_jobs)

    plan = commands.add_parser("plan", help="place the model's layers on devices and predict the step time")
    plan.add_argument(
        "config",
        nargs="?",
        help="path to the YAML config (only base_model's config.json is read); "
        "optional with a --fleet file that has a plan: section",
    )
    plan.add_argument("--fleet", help="YAML list of (hypothetical) devices to plan for instead of local ones")
    plan.add_argument("--json", action="store_true", help="print only the plan, as in output_dir/plan.json")
    plan.add_argument("--model", help="a config.json (or its directory) to plan instead of base_model's")
    plan.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. sequence_len=2048",
    )
    plan.set_defaults(handler=_run_plan)

    devices = commands.add_parser(
        "devices", help="list local devices and profile one layer of the model on each"
    )
    devices.add_argument("config", nargs="?", help="YAML config whose model and batch shape to profile")
    devices.add_argument("--no-profile", action="store_true", help="list devices without profiling")
    devices.add_argument("--json", action="store_true", help="print JSON instead of a table")
    devices.set_defaults(handler=_run_devices)

    agent = commands.add_parser(
        "agent", help="serve this mesh member to launchers (started by `mesh init/join`)"
    )
    agent.add_argument(
        "--state-dir", help="mesh state directory (default: $SHARDPOOL_HOME, /var/lib/shardpool as root)"
    )
    agent.add_argument(
        "--port", type=int, default=AGENT_PORT, help=f"TCP port on the mesh address (default {AGENT_PORT})"
    )
    agent.add_argument("--work-dir", help="where jobs keep their files and logs (default STATE-work)")
    agent.add_argument(
        "--run-as",
        default=DEFAULT_RUN_AS,
        metavar="USER",
        help="the account stage processes run as (never root)",
    )
    agent.add_argument(
        "--group",
        default=DEFAULT_LAUNCH_GROUP,
        help="local users in this group may launch jobs through the agent's socket (default shardpool)",
    )
    agent.add_argument(
        "--socket",
        metavar="PATH",
        help="the agent's local Unix socket (default $SHARDPOOL_AGENT_SOCKET, else /run/shardpool/agent.sock "
        "for /var/lib/shardpool and /run/shardpool/agent-HASH.sock for any other state directory)",
    )
    agent.add_argument("--ready-file", help=argparse.SUPPRESS)
    agent.set_defaults(handler=_run_agent)

    from mesh.cli.parser import add_mesh_commands

    add_mesh_commands(commands)
    return parser


def _run_agent(args: argparse.Namespace) -> int:
    from shardpool.agent.command import run_agent

    return run_agent(
        args.state_dir,
        args.port,
        work_dir=args.work_dir,
        ready_file=args.ready_file,
        run_as=args.run_as,
        group=args.group,
        socket_path=args.socket,
    )


def _run_finetune(args: argparse.Namespace) -> int:
    import os

    from shardpool.console import RunEvents
    from shardpool.torchrun import finetune_under_torchrun, torchrun_world

    world = torchrun_world(os.environ)
    if world is not None:
        finetune_under_torchrun(args.config, world, resume=args.resume)
        return 0

    events = RunEvents(sys.stdout if args.json else None)
    try:
        return _finetune_command(args, events)
    except (ShardpoolError, MeshError) as error:
        events.emit("error", message=str(error))
        raise
    except KeyboardInterrupt:
        events.emit("error", message="interrupted")
        raise


def _finetune_command(args: argparse.Namespace, events: RunEvents) -> int:
    from shardpool.config import load_config

    config = load_config(args.config)  # every config problem at once, before torch is imported
    agent_socket = None
    if args.state_dir is not None:
        if config.shardpool.placement != "mesh":
            raise ShardpoolError(
                f"--state-dir names a mesh, but {args.config} places its stages on this machine; "
                "set `shardpool: {placement: mesh}` or leave out --state-dir"
            )
        from shardpool.agent.local_client import agent_socket_of_state_dir

        agent_socket = agent_socket_of_state_dir(args.state_dir)
    from rich.console import Console

    from shardpool.finetune import finetune

    console = Console(stderr=True) if args.json else None
    finetune(config, resume=args.resume, console=console, events=events, agent_socket=agent_socket)
    return 0


def _run_validate(args: argparse.Namespace) -> int:
    from shardpool.validate import run_validate

    run_validate(args.config, show=args.show, as_json=args.json)
    return 0


def _run_schema(args: argparse.Namespace) -> int:
    import json

    from shardpool.config.json_schema import config_json_schema

    print(json.dumps(config_json_schema(), indent=2))
    return 0


def _run_jobs(args: argparse.Namespace) -> int:
    from shardpool.jobs_command import run_jobs_command

    if args.action in ("show", "stop") and args.job_id is None:
        raise ShardpoolError(
            f"`shardpool jobs {args.action}` needs a job id: `shardpool jobs {args.action} ID`"
        )
    if args.action in (None, "list") and args.job_id is not None:
        raise ShardpoolError(f"did you mean `shardpool jobs show {args.job_id}`?")
    socket_path = args.socket
    if args.state_dir is not None:
        from shardpool.agent.local_client import agent_socket_of_state_dir

        socket_path = agent_socket_of_state_dir(args.state_dir)
    print(run_jobs_command(args.action, args.job_id, socket_path=socket_path))
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    import json

    from shardpool.data.hub import local_model_dir, with_local_sources
    from shardpool.plan.config_plan import load_config_with_overrides, plan_for_config
    from shardpool.plan.fleet import load_fleet
    from shardpool.plan.result import plan_table

    config_path, overrides, model = args.config, list(args.set), args.model
    if config_path is None:
        config_path, overrides, model = _fleet_plan_request(args.fleet, overrides, model)
    config = load_config_with_overrides(config_path, overrides, model_path=model)
    if args.fleet:
        model_path = model or str(local_model_dir(config.base_model, config_only=True))
        plan = plan_for_config(config, fleet=load_fleet(args.fleet), model_path=model_path)
    else:
        from shardpool.plan.profiler import TorchProbe

        config = with_local_sources(config)  # the local devices are profiled with the real layer
        plan = plan_for_config(config, probe=TorchProbe(), model_path=model)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        from rich.console import Console

        from shardpool.console import print_table

        print_table(Console(), plan_table(plan))
    return 0


def _fleet_plan_request(
    fleet: str | None, overrides: list[str], model: str | None
) -> tuple[str, list[str], str | None]:
    """The config, overrides and model a fleet file's ``plan:`` section names, under the command line's."""
    from shardpool.plan.fleet import fleet_plan_request

    if not fleet:
        raise ShardpoolError("shardpool plan needs a config: shardpool plan CONFIG [--fleet FILE]")
    request = fleet_plan_request(fleet)
    if request is None:
        raise ShardpoolError(
            f"fleet file {fleet} has no plan: section naming a config; run shardpool plan CONFIG --fleet {fleet}"
        )
    return request.config, [*request.overrides, *overrides], model or request.model


def _under_torchrun(args: argparse.Namespace, drive: Callable[[Any], None]) -> int | None:
    """``generate``/``serve`` started by torchrun: this rank's part (rank 0 calls ``drive`` with the
    ring's stages, the others run a stage); None when torchrun did not start this process."""
    import os

    from shardpool.torchrun import inference_under_torchrun, torchrun_world

    world = torchrun_world(os.environ)
    if world is None:
        return None
    return inference_under_torchrun(
        world, drive, stages=args.stages, devices=args.devices, placement=args.placement
    )


def _run_generate(args: argparse.Namespace) -> int:
    import json

    from shardpool.generate import GenerateOptions, generate, parse_devices, read_prompt

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    def run(stages_for: Any = None) -> None:
        if args.json:
            generation = generate(args.target, prompt, options, say=_say, stages_for=stages_for)
            print(json.dumps(generation.as_json()))
            return
        generate(args.target, prompt, options, on_text=show, say=_say, stages_for=stages_for)
        sys.stdout.write("\n")

    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        chat=args.chat,
        stages=args.stages,
        devices=parse_devices(args.devices or "cpu"),
        placement=args.placement,
    )
    prompt = args.prompt if args.prompt is not None else read_prompt(args.prompt_file)
    under_torchrun = _under_torchrun(args, run)
    if under_torchrun is not None:
        return under_torchrun
    run()
    return 0


def _say(line: str) -> None:
    """A line of progress on stderr (stdout holds only the command's result)."""
    print(f"shardpool: {line}", file=sys.stderr, flush=True)


def _run_merge(args: argparse.Namespace) -> int:
    from shardpool.model.merge import merge_adapter

    out = merge_adapter(args.output_dir, args.out, dtype=args.dtype)
    print(
        f"merged {args.output_dir} into its base ({args.dtype}): {out}; load it with AutoModelForCausalLM.from_pretrained"
    )
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    import os

    from shardpool.generate import parse_devices, ring_stages
    from shardpool.infer.server import ServerOptions, serve
    from shardpool.infer.target import resolve_target

    options = ServerOptions(
        api_key=args.api_key or os.environ.get("SHARDPOOL_API_KEY") or None,
        max_concurrent=args.max_concurrent,
        max_queued=args.max_queued,
        chat_max_tokens=args.chat_max_tokens,
    )

    def run(stages_for: Any) -> None:
        stages = stages_for(resolve_target(args.target), args.max_context, args.max_concurrent)
        serve(
            args.target, stages, host=args.host, port=args.port, options=options, max_context=args.max_context
        )

    under_torchrun = _under_torchrun(args, run)
    if under_torchrun is not None:
        return under_torchrun
    stages = ring_stages(
        resolve_target(args.target),
        args.placement,
        args.stages,
        parse_devices(args.devices or "cpu"),
        max_context=args.max_context,
        max_slots=args.max_concurrent,
        say=_say,
    )
    serve(args.target, stages, host=args.host, port=args.port, options=options, max_context=args.max_context)
    return 0


def _run_devices(args: argparse.Namespace) -> int:
    from shardpool.plan.report import devices_table, local_devices

    listing = local_devices(args.config, profile=not args.no_profile)
    if args.json:
        import json

        print(json.dumps(listing.rows, indent=2))
    else:
        from rich.console import Console

        from shardpool.console import print_table

        print_table(Console(), devices_table(listing))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script: run one command, print known errors as one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ShardpoolError, MeshError) as error:
        print(f"shardpool: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardpool: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (e.g. `shardpool plan --json | head`): stop quietly.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
