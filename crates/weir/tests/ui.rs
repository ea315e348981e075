//! Issue #36: watching a run. A real browser (headless Chromium) loads the live page of a
//! quota-bound run against `weir sim` and the report after it, and the figures it shows are
//! checked against the run's summary; a run whose endpoint is dead says so on its page.

mod util;

use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, BufReader};
use util::*;

/// Starts `weir run` with `--ui` and waits for it to say where its page is.
async fn start(args: &[String]) -> (tokio::process::Child, String, tokio::task::JoinHandle<String>) {
    let mut child = weir().args(args).args(["--ui"]).stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let url = loop {
        let line = tokio::time::timeout(std::time::Duration::from_secs(30), lines.next_line())
            .await
            .expect("the page's address in time")
            .unwrap()
            .expect("weir said where its page is");
        if let Some(at) = line.find("http://") {
            break line[at..].trim().to_string();
        }
    };
    // The rest of stderr (the summary), read as it comes.
    let rest = tokio::spawn(async move {
        let mut all = String::new();
        while let Ok(Some(l)) = lines.next_line().await {
            all.push_str(&l);
            all.push('\n');
        }
        all
    });
    (child, url, rest)
}

/// `weir run`'s arguments for Gemini at `base`, from `input` to `out`.
fn gemini_at(base: &str, input: &std::path::Path, out: &std::path::Path) -> Vec<String> {
    let args = ["run", "--model", "gemini/gemini-2.5-flash", "--base-url", base, "--id-field", "key"];
    let files = ["--progress", "never", "--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()];
    args.iter().chain(&files).map(|a| a.to_string()).collect()
}

/// The number after `before` in `text` (`calls 300 (` → 300).
fn after(text: &str, before: &str) -> f64 {
    let at = text.find(before).unwrap_or_else(|| panic!("no {before:?} in {text}")) + before.len();
    let digits: String = text[at..]
        .chars()
        .skip_while(|c| *c == ' ')
        .take_while(|c| c.is_ascii_digit() || *c == ',' || *c == '.')
        .collect();
    digits.replace(',', "").trim_end_matches('.').parse().unwrap_or_else(|_| panic!("{before:?} in {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_and_the_report_show_what_the_summary_says() {
    let Some(chromium) = peer("WEIR_CHROMIUM") else { return };
    let mut config = weir_sim::SimConfig::default();
    // A quota the run meets: 40 requests per second, refusals advised in whole seconds.
    config.quota.requests_per_window = 40;
    config.quota.window_secs = 1.0;
    config.quota.round_advice = true;
    let sim = sim(config).await;
    let dir = Dir::new("ui-live");
    let (data, _) = prompts(400);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let base = sim.url();
    let (mut child, url, rest) = start(&gemini_at(&base, &input, &out)).await;
    // The quota holds most of the 400 calls for a while: the page says how many.
    let mut held = Vec::new();
    for _ in 0..30 {
        let update: serde_json::Value =
            reqwest::get(format!("{url}api/update?since=0")).await.unwrap().json().await.unwrap();
        held.push(update["summary"]["held"].as_u64().unwrap_or(0));
        if held.last() > Some(&0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(held.iter().any(|&n| n > 0 && n <= 400), "calls held while the quota is met: {held:?}");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let live = dom(&chromium, &url).await;
    assert_eq!(shown(&live, "state"), "running", "{live}");
    let says = shown(&live, "held");
    assert!(says.is_empty() || (says.contains("held for the quota") && says.starts_with('(')), "{says}");
    let done = number(&live, "records-done");
    assert!(done > 0.0 && done < 400.0, "records done while it runs: {done}");
    assert!(shown(&live, "of-total").contains("400"), "{}", shown(&live, "of-total"));
    assert!(shown(&live, "eta").ends_with('s'), "time left while it runs: {}", shown(&live, "eta"));
    assert!(live.contains(&base), "the endpoint is listed");
    assert!(live.contains("class=\"u-wrap\""), "the charts are drawn (uPlot)");
    // Another host name for this address (DNS rebinding) is refused.
    let foreign = reqwest::Client::new()
        .get(format!("{url}api/update"))
        .header(reqwest::header::HOST, "evil.example.com")
        .send()
        .await
        .unwrap();
    assert_eq!(foreign.status().as_u16(), 403);
    let status = child.wait().await.unwrap();
    let summary = rest.await.unwrap();
    assert_eq!(status.code(), Some(0), "{summary}");
    // The report: the same figures as the summary.
    let report = dir.path("out.jsonl.report.html");
    assert!(summary.contains(&format!("report:  {}", report.display())), "{summary}");
    let html = dom(&chromium, &format!("file://{}", report.display())).await;
    assert_eq!(shown(&html, "state"), "finished");
    assert_eq!(shown(&html, "held"), "", "nothing held once finished");
    assert_eq!(shown(&html, "eta"), "0s");
    assert_eq!(number(&html, "records-done"), 400.0);
    assert_eq!(number(&html, "succeeded"), 400.0);
    assert_eq!(number(&html, "calls"), after(&summary, "calls "), "{summary}");
    assert_eq!(number(&html, "rate-limited"), after(&summary, "retries, "), "{summary}");
    let cost = number(&html, "cost");
    let said = after(&summary, "cost: about $");
    assert!((cost - said).abs() <= 0.00015 + said * 0.001, "report ${cost}, summary ${said}: {summary}");
    assert!(html.contains("weir: 400 records"), "the summary is in the report");
    let s = sim.stats();
    assert_eq!(number(&html, "calls") as u64, s.requests, "every call the simulator saw");
    // Rebuilt from the state directory by `weir report`.
    std::fs::remove_file(&report).unwrap();
    let o = weir().args(["report", "--output", out.to_str().unwrap()]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let again = dom(&chromium, &format!("file://{}", report.display())).await;
    assert_eq!(number(&again, "calls"), number(&html, "calls"));
    assert_eq!(number(&again, "records-done"), 400.0);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_shows_on_the_page_and_in_the_report() {
    let Some(chromium) = peer("WEIR_CHROMIUM") else { return };
    let dir = Dir::new("ui-dead");
    let (data, _) = prompts(50);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let dead = format!("http://127.0.0.1:{}", free_port());
    let (mut child, url, rest) = start(&gemini_at(&dead, &input, &out)).await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    // The run stops about 5 s in; a browser slow to start on a loaded machine (a CI run) can
    // come after its page is gone. Then only the report below is checked.
    match dom_if_served(&chromium, &url).await {
        Ok(live) => {
            let alert = shown(&live, "alert");
            assert!(
                alert.contains("not answering") || alert.contains("Stopped"),
                "the page says the endpoint is dead: {alert:?}"
            );
            assert!(!alert.contains("page does not answer"), "the run's own page answered: {alert:?}");
        }
        Err(_) => eprintln!("the run ended before the browser loaded its page"),
    }
    child.wait().await.unwrap();
    let summary = rest.await.unwrap();
    let html = dom(&chromium, &format!("file://{}", dir.path("out.jsonl.report.html").display())).await;
    assert!(shown(&html, "alert").starts_with("Stopped"), "{summary}");
    assert!(shown(&html, "state").starts_with("stopped"), "{}", shown(&html, "state"));
    assert_eq!(number(&html, "records-done"), 0.0, "{summary}");
    assert!(html.contains("50 records not finished"), "the summary is in the report");
}

/// `--ui` off loopback, or a report path with no directory, is a usage error before anything
/// is done; `--no-report` writes none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ui_and_report_flags_are_checked_and_no_report_writes_none() {
    let dir = Dir::new("ui-flags");
    let (data, _) = prompts(5);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let base = ["run", "--model", "sim/demo", "--input", input.to_str().unwrap(), "--output", out.to_str().unwrap()];
    let same = format!("127.0.0.1:{}", free_port());
    for (extra, says) in [
        (vec!["--ui", "0.0.0.0:0"], "loopback only"),
        (vec!["--report", "/nonexistent-dir/r.html"], "no directory"),
        (vec!["--report", "r.html", "--no-report"], "cannot be used with"),
        // Each free alone, the same for both: found out before any file is made (a re-run
        // took the files left for a run to resume).
        (vec!["--ui", &same, "--metrics-listen", &same], "the same address"),
    ] {
        let o = weir().args(base).args(&extra).output().await.unwrap();
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{extra:?}: {}", stderr(&o));
        assert!(!out.exists(), "nothing written");
    }
    // A report is never written over a file it did not write: the run's own, another's, a device.
    let other = dir.write("results-of-another-run.jsonl", b"{\"id\":\"x\"}\n");
    for (target, says) in [
        (input.to_str().unwrap(), "one of the run's own files"),
        (other.to_str().unwrap(), "not a report weir wrote"),
        ("/dev/null", "not a device"),
    ] {
        let o = weir().args(base).args(["--report", target]).output().await.unwrap();
        assert_eq!(o.status.code(), Some(2), "{target}: {}", stderr(&o));
        assert!(stderr(&o).contains(says) || stderr(&o).contains("device"), "{target}: {}", stderr(&o));
    }
    assert_eq!(std::fs::read(&other).unwrap(), b"{\"id\":\"x\"}\n");
    assert_eq!(std::fs::read(&input).unwrap(), data);
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
    let o = weir().args(base).args(["--no-report"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!dir.path("out.jsonl.report.html").exists());
    let o = weir().args(base).args(["--fresh"]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let html = std::fs::read_to_string(dir.path("out.jsonl.report.html")).unwrap();
    assert!(html.contains("uPlot") && !html.contains("<script src"), "self-contained");
    // The errors file by default (not written yet: no errors) and the state directory's files
    // are the run's own too: refused before the run, with nothing done.
    let results = std::fs::read(&out).unwrap();
    for target in [dir.path("out.errors.jsonl"), dir.path(".weir/runs/out.jsonl.series.json")] {
        let o = weir().args(base).args(["--fresh", "--report", target.to_str().unwrap()]).output().await.unwrap();
        assert_eq!(o.status.code(), Some(2), "{}: {}", target.display(), stderr(&o));
        assert!(stderr(&o).contains("--report"), "{}", stderr(&o));
    }
    assert_eq!(std::fs::read(&out).unwrap(), results, "the results are untouched");
    // A resumed run's page says how many records were done before it.
    let o = weir().args(base).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // A re-run with nothing left keeps the report and the series it came from: written over,
    // the plots of the run that did the work were gone.
    let series = dir.path(".weir/runs/out.jsonl.series.json");
    let kept = (std::fs::read(dir.path("out.jsonl.report.html")).unwrap(), std::fs::read(&series).unwrap());
    let o = weir().args(base).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("5 of 5 finished"), "{}", stderr(&o));
    assert_eq!(std::fs::read(dir.path("out.jsonl.report.html")).unwrap(), kept.0, "the report is kept");
    assert_eq!(std::fs::read(&series).unwrap(), kept.1, "the series is kept");
    // Asked at a new path, the report is that earlier run's (it was an empty one of the re-run).
    let other = dir.path("other.html");
    let o = weir().args(base).args(["--report", other.to_str().unwrap()]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let html = std::fs::read_to_string(&other).unwrap();
    assert!(html.contains("\"done\":5,"), "the earlier run's figures");
}

/// The page while a Ctrl-C's stop is under way, and `weir report` asked about a run still going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_under_way_is_on_the_page_and_a_report_of_a_run_going_on_says_so() {
    // Calls of 8 s, four at a time: a stop waits for those in flight.
    let mut config = weir_sim::SimConfig::default();
    config.latency.fixed_ms = 8_000.0;
    let sim = sim(config).await;
    let dir = Dir::new("ui-stopping");
    let (data, _) = prompts(40);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let mut args = gemini_at(&sim.url(), &input, &out);
    args.extend(["--concurrency", "fixed", "--max-concurrency", "4"].map(String::from));
    let (child, url, rest) = start(&args).await;
    // The series is saved in the run's first second: `weir report` finds it, and the run's
    // output locked (it was said to have been killed).
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let mid = dir.path("mid.html");
    let o = weir()
        .args(["report", "--output", out.to_str().unwrap(), "--report", mid.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("still going"), "{}", stderr(&o));
    let html = std::fs::read_to_string(&mid).unwrap();
    assert!(html.contains("The run is still going") && !html.contains("killed?"), "{}", &html[..200]);
    // Not over the default report, which the run writes at its end.
    let o = weir().args(["report", "--output", out.to_str().unwrap()]).output().await.unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("give --report PATH"), "{}", stderr(&o));
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    // Sampled once a second: within 2 s the page says the stop, gives no time left, and counts
    // none of the records the stop cut off as failed.
    tokio::time::sleep(std::time::Duration::from_millis(2000)).await;
    let api = format!("{}/api/update?since=0", url.trim_end_matches('/'));
    let v: serde_json::Value = reqwest::get(&api).await.unwrap().json().await.unwrap();
    let s = &v["summary"];
    assert!(s["state"].as_str().unwrap().starts_with("stopping"), "{s}");
    assert!(s["alert"].as_str().unwrap().starts_with("Stopping"), "{s}");
    assert!(s["eta_secs"].is_null() && s["failed"] == 0, "{s}");
    let o = child.wait_with_output().await.unwrap();
    let err = rest.await.unwrap();
    assert_eq!(o.status.code(), Some(130), "{err}");
    let report = std::fs::read_to_string(dir.path("out.jsonl.report.html")).unwrap();
    assert!(report.contains("\"failed\":0,"), "no failures in the report's summary");
    // Resumed, the rest in one wave: its report counts the records done before.
    let mut args = gemini_at(&sim.url(), &input, &out);
    args.extend(["--max-concurrency", "64"].map(String::from));
    let o = weir().args(&args).output().await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let report = std::fs::read_to_string(dir.path("out.jsonl.report.html")).unwrap();
    assert!(report.contains("\"resumed\":4,"), "the records done before are on the page");
    sim.shutdown().await;
}

/// Provider batch jobs on the page: their states while they run, and in the report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_jobs_and_their_states_are_on_the_page() {
    let Some(chromium) = peer("WEIR_CHROMIUM") else { return };
    let mut config = weir_sim::SimConfig::default();
    config.batch.run_secs = 6.0;
    let sim = sim(config).await;
    let dir = Dir::new("ui-jobs");
    let (data, _) = prompts(60);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let mut args = gemini_at(&sim.url(), &input, &out);
    args.extend(["--mode", "batch", "--poll-secs", "0.2", "--job-max-requests", "30"].map(String::from));
    let (mut child, url, rest) = start(&args).await;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let live = dom(&chromium, &url).await;
    let jobs = shown(&live, "jobs-line");
    assert!(jobs.contains("requests answered"), "the jobs are on the page: {jobs:?}");
    let table = &live[live.find("id=\"jobs\"").unwrap()..];
    assert!(table.contains("<td class=\"n\">2</td>"), "two jobs in one state: {}", &table[..table.len().min(400)]);
    let status = child.wait().await.unwrap();
    let summary = rest.await.unwrap();
    assert_eq!(status.code(), Some(0), "{summary}");
    let html = dom(&chromium, &format!("file://{}", dir.path("out.jsonl.report.html").display())).await;
    assert_eq!(number(&html, "records-done"), 60.0, "{summary}");
    assert!(shown(&html, "jobs-line").contains("records settled"), "{}", shown(&html, "jobs-line"));
    // The cost chart prices what jobs settled at the batch share, as the summary does (it
    // showed the online price, twice the summary's).
    let series = walk(&dir.0).into_iter().find(|p| p.to_string_lossy().ends_with(".series.json")).unwrap();
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(series).unwrap()).unwrap();
    let charted = saved["columns"]["cost"].as_array().unwrap().last().unwrap().as_f64().unwrap();
    let said = after(&summary, "cost: about $");
    assert!((charted - said).abs() <= said * 0.01, "chart ${charted}, summary ${said}: {summary}");
    sim.shutdown().await;
}

/// A run stopped at once (Ctrl-C twice) still writes its report, from the series it saved last
/// (found by an outside tester: it wrote none).
#[tokio::test(flavor = "multi_thread")]
async fn a_run_stopped_at_once_writes_its_report_from_the_saved_series() {
    // Calls of 10 s: the first press waits for them, the second does not.
    let mut config = weir_sim::SimConfig::default();
    config.latency.fixed_ms = 10_000.0;
    let sim = sim(config).await;
    let dir = Dir::new("ui-stopped-at-once");
    let (data, _) = prompts(200);
    let input = dir.write("in.jsonl", &data);
    let out = dir.path("out.jsonl");
    let child = weir()
        .args(["run", "--model", "gemini/gemini-2.5-flash", "--base-url", &sim.url(), "--id-field", "key"])
        .args(["--input", input.to_str().unwrap(), "--output", out.to_str().unwrap(), "--progress", "never"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let pid = child.id().unwrap().to_string();
    for _ in 0..2 {
        assert!(std::process::Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let o = child.wait_with_output().await.unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("stopped at once") && err.contains("report written to"), "{err}");
    // Its own report, not one of a run "still going" (it holds its output's lock as it ends).
    assert!(!err.contains("still going"), "{err}");
    let report = std::fs::read_to_string(dir.path("out.jsonl.report.html")).unwrap();
    assert!(report.starts_with("<!doctype html>"), "{}", &report[..80.min(report.len())]);
    assert!(!report.contains("The run is still going"), "the report of a run that ended");
    sim.shutdown().await;
}
