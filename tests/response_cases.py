"""A response's state read the lean way (``store.responses.get_response_state``: some of the job's columns
and the first message of its context) tells exactly what the whole rows tell, on Postgres
(tests/integration/test_openai_responses.py) and SQLite (tests/unit/test_responses_wire.py)."""

from __future__ import annotations

import uuid

from conductor.responses import response_object
from conductor.store.db import session_scope
from conductor.store.models import Job, OpenAIResponse, utcnow
from conductor.store.responses import get_response, get_response_state


def check_the_lean_read_is_the_whole_rows() -> None:
    tenant = f"responses-{uuid.uuid4().hex[:8]}"
    context = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "2+2? " * 500},
               {"role": "assistant", "content": "4"}]
    cases = [  # (job fields, whether the context begins with instructions[, the response it continues])
        ({"status": "running", "context": context, "meta": {"team": "x", "n": "1"}}, True),
        ({"status": "succeeded", "context": context, "answer": "36", "finished_at": utcnow(),
          "limits": {"max_answer_tokens": 4}}, True,
         uuid.uuid4().hex),
        ({"status": "succeeded", "context": context, "answer": "12", "input_tokens": 7, "output_tokens": 3,
          "cost_usd": 0.5, "calls": 2, "finished_at": utcnow()}, False),
        ({"status": "failed", "context": None, "error_type": "budget_exceeded", "error_message": "no room",
          "finished_at": utcnow()}, False),
        ({"status": "queued", "context": [{"role": "system", "content": 'quotes " and \\ and é'}]}, True),
    ]
    with session_scope() as s:
        ids = []
        for fields, instructions, *previous in cases:
            job = Job(tenant=tenant, task="And times 3?", pool="default", planner="conductor", **fields)
            s.add(job)
            s.flush()
            s.add(OpenAIResponse(job_id=job.id, model="conductor", background=True, instructions=instructions,
                                 previous_response_id=previous[0] if previous else None))
            ids.append(job.id)
    with session_scope() as s:
        for job_id in ids:
            whole, lean = get_response(s, job_id=job_id, tenant=tenant), get_response_state(s, job_id=job_id,
                                                                                            tenant=tenant)
            assert whole is not None and lean is not None
            assert response_object(*lean) == response_object(*whole)
            assert lean[1].previous_response_id == whole[1].previous_response_id
        other = get_response_state(s, job_id=ids[0], tenant="someone-else")
        plain = Job(tenant=tenant, task="t", pool="default", planner="conductor")  # not a response
        s.add(plain)
        s.flush()
        assert other is None and get_response_state(s, job_id=plain.id, tenant=tenant) is None
