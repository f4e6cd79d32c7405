"""An honest run: one call with its own credentials; it stays a while (INSIDER_LINGER seconds, on the
task INSIDER_LINGER_ON) so that concurrent runs can try to read its environment."""

import os
import sys
import time

from common import legit_answer, report

prompt = sys.stdin.read()
answer = legit_answer(sys.argv[1], prompt)
print(answer, flush=True)
if f"-{os.environ.get('INSIDER_LINGER_ON', '')}-" in os.environ["STEPMILL_TRAJECTORY"]:
    time.sleep(float(os.environ.get("INSIDER_LINGER", "0")))
report({"trajectory": os.environ["STEPMILL_TRAJECTORY"], "answer": answer, "uid": os.getuid()})
