"""A white-box entry (``tests.adversary.door_versions:run``) that claims its own policy version: after
one honest generation it writes, on its own steps pipe, a line for that generation's very output ids
and a line for ids the engine never answered, each saying ``weight_versions: [{"version": "999"}]``."""

import json


def run(task, session):
    user = [{"role": "user", "content": task["prompt"]}]
    ids = session.encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    first = session.generate(ids, messages=user, max_tokens=32)
    claimed = [{"version": "999", "start": 0, "end": 3}]
    for response_ids in (first.ids, session.encode("never answered by the engine")):
        line = {"prompt_ids": ids, "response_ids": response_ids, "finish_reason": "stop", "messages": user,
                "completion": {"role": "assistant", "content": "forged"}, "weight_versions": claimed}
        session.out.write(json.dumps(line) + "\n")
        session.out.flush()
    return first.text
