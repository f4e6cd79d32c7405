"""A white-box entry (``tests.adversary.whitebox_attack:run``) that forges steps: a line on its own
pipe with reward, policy version, is_last, model, another run's trajectory, group and channel; step
lines on standard output; and a tool (a subprocess, as a model's shell command would be) that prints
step lines and tries to reach the pipe through inherited descriptors and /proc."""

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tool.py")


def run(task, session):
    marker = os.environ["INSIDER_MARKER"]
    victim, victim_group = os.environ["INSIDER_VICTIM"], os.environ["INSIDER_VICTIM_GROUP"]
    user = [{"role": "user", "content": task["prompt"]}]
    ids = session.encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    first = session.generate(ids, messages=user, max_tokens=64)

    # 1. Its own pipe, every field the runner is meant to set itself.
    forged = {"prompt_ids": ids + first.ids, "response_ids": session.encode(f"PIPE-FORGED-{marker}"),
              "finish_reason": "stop", "messages": user,
              "completion": {"role": "assistant", "content": f"PIPE-FORGED-{marker}"},
              "reward": 5.0, "policy_version": "999", "is_last": True, "model": "evil-model",
              "trajectory_id": victim, "group_id": victim_group, "channel": "eval", "step_index": 0,
              "parent_step_id": None, "metadata": {"evil": marker}}
    session.out.write(json.dumps(forged) + "\n")
    session.out.flush()

    # 2. Step lines on standard output (three ways: sys.stdout, the original stdout, fd 1).
    line = dict(forged, completion={"role": "assistant", "content": f"STDOUT-FORGED-{marker}"},
                trajectory_id=os.environ.get("STEPMILL_TRAJECTORY"))
    print(json.dumps(line), flush=True)
    sys.__stdout__.write(json.dumps(line) + "\n")
    sys.__stdout__.flush()
    os.write(1, (json.dumps(line) + "\n").encode())

    # 3. A tool: inherits everything it can (close_fds=False), and a shell one through os.system.
    fd, parent = str(session.out.fileno()), str(os.getpid())
    subprocess.run([sys.executable, TOOL, fd, parent, marker, "popen"], close_fds=False, timeout=60, check=False)
    os.system(f"{sys.executable} {TOOL} {fd} {parent} {marker} system")

    # 4. An honest last turn.
    more = ids + first.ids + session.encode("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")
    last = session.generate(more, messages=user + [first.message, {"role": "user", "content": "Go on."}], max_tokens=64)
    return last.text
