-- Fills a migrated, empty Conductor Queue database with a large tenant's history, for EXPLAIN ANALYZE of
-- the list, batch, reconciler and webhook queries at scale (docs/benchmarks.md, "Queries at scale"):
--   createdb review_scale2 && conductor migrate (CONDUCTOR_DATABASE_URL=…/review_scale2)
--   psql -d review_scale2 -f bench/scale_fill.sql
-- Tenant "big": 1.6M top-level jobs over 60 days (≈27k a day; half of them, all ended, with the tenant's
-- default webhook URL: ≈13k a day), 97 % succeeded, 1 % failed, 0.05 % cancelled, 49k queued with their
-- plan sent (every other job of the newest 98k) and 300 running; 60k
-- child jobs; 3 steps a job (≈5M); a 50k-line batch still running (500 lines refused) and 300 older
-- batches; 2,000 stored files. Tenant "small": 60k jobs. Takes a few minutes on 2 cores.
\set ON_ERROR_STOP on
SET synchronous_commit = off;

INSERT INTO tenant_settings (tenant, webhook_url, updated_at) VALUES ('big', 'https://hooks.example/big', now());

-- Top-level jobs of "big": i = 1 is the newest, one every 3.24 s going back.
INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, planner_attempts,
                 planner_input_tokens, planner_output_tokens, planner_cost_usd, planner_calls, input_tokens,
                 output_tokens, cost_usd, calls, limits, metadata, webhook_url, cancel_requested, plan_claims,
                 plan_resends, replay_replan, created_at, updated_at, enqueued_at, started_at, finished_at)
SELECT md5('big' || i), 'big',
       CASE WHEN i <= 98000 AND i % 2 = 1 THEN CASE WHEN i % 157 = 0 THEN 'running' ELSE 'queued' END
            WHEN i % 2000 = 0 THEN 'cancelled'
            WHEN i % 100 = 7 THEN 'failed'
            ELSE 'succeeded' END,
       'task ' || i, 'default', '{}', 'template', 0, 1, 0, 0, 0, 0, 100, 50, 0.001, 3, '{}',
       jsonb_build_object('project', 'p' || (i % 50), 'run', i % 1000),
       CASE WHEN i % 2 = 0 THEN 'https://hooks.example/big' END,
       false, 1, 0, false,
       now() - i * interval '3.24 s',
       now() - i * interval '3.24 s' + CASE WHEN i <= 98000 AND i % 2 = 1 THEN interval '0' ELSE interval '20 s' END,
       now() - i * interval '3.24 s' + interval '10 ms',
       CASE WHEN i > 98000 OR i % 2 = 0 OR i % 157 = 0 THEN now() - i * interval '3.24 s' + interval '1 s' END,
       CASE WHEN i > 98000 OR i % 2 = 0 THEN now() - i * interval '3.24 s' + interval '20 s' END
FROM generate_series(1, 1600000) AS i;

-- Child jobs (recursive steps' runs): not listed, not counted in flight.
INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, parent_job_id, root_job_id,
                 planner_attempts, planner_input_tokens, planner_output_tokens, planner_cost_usd, planner_calls,
                 input_tokens, output_tokens, cost_usd, calls, limits, metadata, cancel_requested, plan_claims,
                 plan_resends, replay_replan, created_at, updated_at, enqueued_at, finished_at)
SELECT md5('child' || i), 'big', 'succeeded', 'sub ' || i, 'default', '{}', 'template', 1,
       md5('big' || (i * 25 + 100000)), md5('big' || (i * 25 + 100000)), 1, 0, 0, 0, 0, 10, 5, 0.0001, 1, '{}',
       '{}', false, 1, 0, false,
       now() - (i * 25 + 100000) * interval '3.24 s' + interval '2 s',
       now() - (i * 25 + 100000) * interval '3.24 s' + interval '10 s',
       now() - (i * 25 + 100000) * interval '3.24 s' + interval '2 s',
       now() - (i * 25 + 100000) * interval '3.24 s' + interval '10 s'
FROM generate_series(1, 60000) AS i;

-- Another tenant.
INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, planner_attempts,
                 planner_input_tokens, planner_output_tokens, planner_cost_usd, planner_calls, input_tokens,
                 output_tokens, cost_usd, calls, limits, metadata, cancel_requested, plan_claims, plan_resends,
                 replay_replan, created_at, updated_at, enqueued_at, finished_at)
SELECT md5('small' || i), 'small', 'succeeded', 'task ' || i, 'default', '{}', 'template', 0, 1, 0, 0, 0, 0,
       100, 50, 0.001, 3, '{}', '{}', false, 1, 0, false,
       now() - i * interval '170 s', now() - i * interval '170 s' + interval '20 s',
       now() - i * interval '170 s', now() - i * interval '170 s' + interval '20 s'
FROM generate_series(1, 60000) AS i;

-- Three steps a job of "big" (top-level and children).
INSERT INTO step (job_id, index, agent, instruction, access_list, access_all, status, input_tokens,
                  output_tokens, cost_usd, attempts, resends, reserved_usd, reserved_tokens, queued_at,
                  started_at, finished_at)
SELECT j.id, s, 'worker', 'do part ' || s, '[]', false,
       CASE WHEN j.status IN ('succeeded', 'failed', 'cancelled') THEN 'succeeded' ELSE 'pending' END,
       30, 20, 0.0003, 1, 0, 0, 0, j.created_at, j.started_at, j.finished_at
FROM job j CROSS JOIN generate_series(0, 2) AS s
WHERE j.tenant = 'big';

-- Older batches (listing), and one running batch of 50,000 lines: 49,500 jobs (created now, 10k of them
-- still queued, the rest ended) and 500 lines refused at creation (no job).
INSERT INTO batch (id, tenant, status, endpoint, input_file_id, completion_window, total, created_at,
                   in_progress_at, expires_at, completed_at)
SELECT 'batch_' || md5('old' || i), 'big', 'completed', '/v1/jobs', 'file-x', '24h', 10,
       now() - i * interval '1 hour', now() - i * interval '1 hour', now() - i * interval '1 hour' + interval '24 h',
       now() - i * interval '1 hour' + interval '1 hour'
FROM generate_series(1, 300) AS i;
INSERT INTO batch (id, tenant, status, endpoint, input_file_id, completion_window, total, created_at,
                   in_progress_at, expires_at)
VALUES ('batch_' || md5('big batch'), 'big', 'in_progress', '/v1/jobs', 'file-x', '24h', 50000,
        now() - interval '30 min', now() - interval '30 min', now() + interval '23 h 30 min');
INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, planner_attempts,
                 planner_input_tokens, planner_output_tokens, planner_cost_usd, planner_calls, input_tokens,
                 output_tokens, cost_usd, calls, limits, metadata, cancel_requested, plan_claims, plan_resends,
                 replay_replan, batch_id, created_at, updated_at, enqueued_at, finished_at)
SELECT md5('line' || i), 'big', CASE WHEN i <= 10000 THEN 'queued' WHEN i % 50 = 0 THEN 'failed' ELSE 'succeeded' END,
       'line ' || i, 'default', '{}', 'template', 0, 1, 0, 0, 0, 0, 100, 50, 0.001, 3, '{}', '{}', false, 1, 0,
       false, 'batch_' || md5('big batch'), now() - interval '30 min', now() - interval '30 min' + i * interval '30 ms',
       now() - interval '30 min', CASE WHEN i > 10000 THEN now() - interval '30 min' + i * interval '30 ms' END
FROM generate_series(1, 49500) AS i;
INSERT INTO batch_request (batch_id, line, custom_id, job_id, error_code, error)
SELECT 'batch_' || md5('big batch'), i, 'req-' || i,
       CASE WHEN i <= 49500 THEN md5('line' || i) END,
       CASE WHEN i > 49500 THEN 'invalid_body' END,
       CASE WHEN i > 49500 THEN 'line ' || i || ': invalid body' END
FROM generate_series(1, 50000) AS i;

INSERT INTO stored_file (id, tenant, purpose, filename, size_bytes, lines, content, created_at)
SELECT 'file-' || md5('f' || i), 'big', CASE WHEN i % 3 = 0 THEN 'batch_output' ELSE 'batch' END,
       'in.jsonl', 100, 1, '\x7b7d'::bytea, now() - i * interval '20 min'
FROM generate_series(1, 2000) AS i;

-- Webhook deliveries for the ended jobs of the last two days that had a URL (none owed).
INSERT INTO webhook_delivery (id, job_id, tenant, url, event_type, status, attempts, next_attempt_at, resends,
                              created_at, finished_at)
SELECT 'msg_' || j.id, j.id, j.tenant, j.webhook_url, 'job.' || j.status, 'delivered', 1, j.finished_at, 0,
       j.finished_at, j.finished_at
FROM job j
WHERE j.webhook_url IS NOT NULL AND j.finished_at >= now() - interval '2 days' AND j.parent_job_id IS NULL;

ANALYZE;
