from tokenmill.protocol import SchedulerStats
from tokenmill.metrics.stats_logger import StatsLogger


def test_logs_rates_and_hit_rate_once_per_interval(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("tokenmill.metrics.stats_logger.time.monotonic", lambda: clock[0])
    logger = StatsLogger(interval_s=5.0)
    logger.record_step(scheduled_tokens=500, generated_tokens=50)
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=200,
                           prefix_cache_hits=50, num_preemptions=1)
    clock[0] = 102.0
    assert logger.maybe_log(stats) is None  # too early
    clock[0] = 105.0
    line = logger.maybe_log(stats)
    assert "running: 3 reqs" in line and "waiting: 2 reqs" in line and "KV cache usage: 25.0%" in line
    assert "prefix cache hit rate: 25.0%" in line and "preemptions: 1" in line
    assert "scheduled: 100.0 tok/s" in line and "generated: 10.0 tok/s" in line
    clock[0] = 111.0
    assert "prefix cache hit rate: 0.0%" in logger.maybe_log(stats)  # rates are per interval
