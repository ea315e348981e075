//! The SQL functions on a local table against `weir sim`: one result per row, NULL and an error
//! struct for rows that fail, fail-on-error mode, embeddings, and queries that cannot work.

use datafusion::arrow::array::{Array, AsArray, RecordBatch, StringArray, UInt32Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, UInt32Type, UInt64Type};
use datafusion::datasource::MemTable;
use datafusion::prelude::{SessionConfig, SessionContext};
use std::sync::Arc;
use weir_core::{RetryPolicy, ThrottleSettings};
use weir_datafusion::{Runtime, RuntimeSettings};
use weir_providers::ProviderOptions;
use weir_sim::{SimConfig, SimServer};

/// Rows `(id, prompt)`: `n` prompts unique to `tag`, split over `parts` partitions; the prompt of
/// each id in `faults` carries that simulator directive.
fn table(n: u32, parts: usize, tag: &str, faults: &[(u32, &str)]) -> MemTable {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::UInt32, false),
        Field::new("prompt", DataType::Utf8, true),
    ]));
    let per = (n as usize).div_ceil(parts);
    let batches: Vec<Vec<RecordBatch>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(per)
        .map(|ids| {
            let prompts: Vec<String> = ids
                .iter()
                .map(|i| match faults.iter().find(|(f, _)| f == i) {
                    Some((_, d)) => format!("{tag} {i}: {d}"),
                    None => format!("{tag} {i}: name a river"),
                })
                .collect();
            let batch = RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(UInt32Array::from(ids.to_vec())), Arc::new(StringArray::from(prompts))],
            )
            .unwrap();
            vec![batch]
        })
        .collect();
    MemTable::try_new(schema, batches).unwrap()
}

async fn setup(shape: impl FnOnce(&mut SimConfig), max_retries: u32) -> (SimServer, Arc<Runtime>, SessionContext) {
    let mut config = SimConfig::default();
    shape(&mut config);
    let sim = SimServer::start(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut settings = RuntimeSettings {
        provider: ProviderOptions { base_url: Some(sim.url()), ..Default::default() },
        throttle: ThrottleSettings::default(),
        ..Default::default()
    };
    settings.driver.retry = RetryPolicy { max_retries, ..RetryPolicy::default() };
    settings.driver.retry.base = std::time::Duration::from_millis(5);
    let functions = Runtime::new(settings);
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
    weir_datafusion::register(&ctx, &functions);
    (sim, functions, ctx)
}

const MODEL: &str = "gemini/gemini-2.5-flash";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_gets_one_result_and_failures_are_null_with_a_reason() {
    let (sim, functions, ctx) = setup(|_| {}, 2).await;
    let faults = [(7, "[sim:block_prompt]"), (30, "[sim:error_500]")];
    ctx.register_table("t", Arc::new(table(60, 3, "rows", &faults))).unwrap();
    let sql = format!(
        "SELECT id, llm_generate('{MODEL}', prompt) AS answer, llm_generate_result('{MODEL}', prompt) AS r FROM t ORDER BY id"
    );
    let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
    let mut seen = Vec::new();
    for b in &batches {
        let ids = b.column(0).as_primitive::<UInt32Type>();
        let answers = b.column(1).as_string::<i32>();
        let r = b.column(2).as_struct();
        let kind = r.column_by_name("error_kind").unwrap().as_string::<i32>();
        let message = r.column_by_name("error_message").unwrap().as_string::<i32>();
        let response = r.column_by_name("response").unwrap().as_string::<i32>();
        let attempts = r.column_by_name("attempts").unwrap().as_primitive::<UInt32Type>();
        let tokens = r.column_by_name("output_tokens").unwrap().as_primitive::<UInt64Type>();
        let model = r.column_by_name("model").unwrap().as_string::<i32>();
        for i in 0..b.num_rows() {
            let id = ids.value(i);
            seen.push(id);
            assert_eq!(model.value(i), MODEL);
            match id {
                7 => {
                    assert!(answers.is_null(i) && response.is_null(i));
                    assert_eq!(kind.value(i), "blocked");
                    assert_eq!(attempts.value(i), 1, "a blocked prompt is not retried");
                }
                30 => {
                    assert!(answers.is_null(i) && response.is_null(i));
                    assert_eq!(kind.value(i), "server", "{}", message.value(i));
                    assert_eq!(attempts.value(i), 3, "the first call and two retries");
                }
                _ => {
                    assert!(!answers.value(i).is_empty(), "row {id}");
                    assert!(kind.is_null(i) && message.is_null(i), "row {id}: {}", message.value(i));
                    assert!(!response.value(i).is_empty() && tokens.value(i) > 0);
                    assert_eq!(attempts.value(i), 1);
                }
            }
        }
    }
    assert_eq!(seen, (0..60).collect::<Vec<_>>(), "one result per row, none lost or repeated");
    // Each function called every row: 58 good rows twice, the blocked one twice, the failing
    // one three times per function.
    assert_eq!(sim.stats().requests, 2 * 58 + 2 + 2 * 3);
    let m = &functions.metrics_by_model()[MODEL];
    assert_eq!(m.succeeded.load(std::sync::atomic::Ordering::Relaxed), 2 * 58);
    assert_eq!(m.failed.load(std::sync::atomic::Ordering::Relaxed), 4);
    functions.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn null_prompts_make_no_call_and_give_null() {
    let (sim, _f, ctx) = setup(|_| {}, 0).await;
    let sql = format!(
        "SELECT llm_generate('{MODEL}', p) AS a, llm_generate_result('{MODEL}', p) AS r \
         FROM (VALUES ('nulls: one'), (NULL), ('nulls: two')) AS v(p)"
    );
    let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 3);
    let nulls: usize = batches.iter().map(|b| b.column(0).null_count()).sum();
    let struct_nulls: usize = batches.iter().map(|b| b.column(1).null_count()).sum();
    assert_eq!((nulls, struct_nulls), (1, 1));
    assert_eq!(sim.stats().requests, 4);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_on_error_fails_the_query_and_names_the_row() {
    let (sim, _f, ctx) = setup(|_| {}, 1).await;
    ctx.register_table("t", Arc::new(table(10, 1, "strict", &[(4, "[sim:block_prompt]")]))).unwrap();
    let sql = format!("SELECT id, llm_generate('{MODEL}', prompt, '{{\"fail_on_error\": true}}') FROM t");
    let err = ctx.sql(&sql).await.unwrap().collect().await.unwrap_err().to_string();
    assert!(err.contains("fail_on_error") && err.contains("blocked"), "{err}");
    assert!(err.contains("prompt \"strict 4: [sim:block_prompt]\""), "the row is named by its prompt: {err}");
    // Without it, the same query answers every row.
    let sql = format!("SELECT count(llm_generate('{MODEL}', prompt, '{{\"temperature\": 0.1}}')) FROM t");
    let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
    assert_eq!(batches[0].column(0).as_primitive::<datafusion::arrow::datatypes::Int64Type>().value(0), 9);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_that_cannot_work_fail_with_what_to_fix() {
    let (sim, _f, ctx) = setup(|_| {}, 0).await;
    ctx.register_table("t", Arc::new(table(3, 1, "bad", &[]))).unwrap();
    for (sql, expect) in [
        ("SELECT llm_generate('gpt-4', prompt) FROM t", "provider/model"),
        ("SELECT llm_generate('mistral/large', prompt) FROM t", "unknown provider"),
        (&*format!("SELECT llm_generate('{MODEL}', prompt, '{{\"temprature\": 1}}') FROM t"), "temprature"),
        (&*format!("SELECT llm_generate('{MODEL}', prompt, 'temperature=1') FROM t"), "not JSON"),
        (&*format!("SELECT llm_embed('{MODEL}', prompt, '{{\"temperature\": 1}}') FROM t"), "does not apply"),
    ] {
        let err = ctx.sql(sql).await.unwrap().collect().await.unwrap_err().to_string();
        assert!(err.contains(expect), "{sql}: {err}");
    }
    assert_eq!(sim.stats().requests, 0);
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_come_batched_one_vector_per_row() {
    let (sim, _f, ctx) = setup(|c| c.embedding.dimensions = 16, 0).await;
    ctx.register_table("t", Arc::new(table(250, 2, "vectors", &[]))).unwrap();
    let sql = "SELECT id, llm_embed('gemini/text-embedding-004', prompt) AS v, \
               llm_embed_result('gemini/text-embedding-004', prompt) AS r FROM t";
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    let mut ids = Vec::new();
    for b in &batches {
        let v = b.column(1).as_list::<i32>();
        let r = b.column(2).as_struct();
        let rv = r.column_by_name("embedding").unwrap().as_list::<i32>();
        for i in 0..b.num_rows() {
            ids.push(b.column(0).as_primitive::<UInt32Type>().value(i));
            assert_eq!(v.value(i).len(), 16);
            assert_eq!(rv.value(i).len(), 16);
        }
    }
    ids.sort();
    assert_eq!(ids, (0..250).collect::<Vec<_>>());
    // Many rows per call (Gemini takes up to 100): far fewer calls than rows.
    let calls = sim.stats().requests;
    assert!(calls <= 2 * 6, "{calls} calls for 2 × 250 rows");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_inside_aggregates_are_computed_below_them() {
    let (sim, _f, ctx) = setup(|_| {}, 0).await;
    ctx.register_table("t", Arc::new(table(40, 2, "aggregates", &[(3, "[sim:block_prompt]")]))).unwrap();
    let sql = format!(
        "SELECT count(llm_generate('{MODEL}', prompt)) AS answered, \
                count(*) FILTER (WHERE llm_generate_result('{MODEL}', prompt)['error_kind'] = 'blocked') AS blocked \
         FROM t"
    );
    let frame = ctx.sql(&sql).await.unwrap();
    // The calls sit in a projection under the aggregate, not inside it.
    let plan = frame.clone().into_optimized_plan().unwrap().display_indent().to_string();
    let (aggregate, projection) = (plan.find("Aggregate:").unwrap(), plan.find("__weir_call_0").unwrap());
    assert!(projection > aggregate && plan.contains("AS __weir_call_0"), "{plan}");
    let batches = frame.collect().await.unwrap();
    let column = |i: usize| batches[0].column(i).as_primitive::<datafusion::arrow::datatypes::Int64Type>().value(0);
    assert_eq!((column(0), column(1)), (39, 1));
    // The output columns keep their names.
    assert_eq!(batches[0].schema().field(0).name(), "answered");
    let grouped =
        format!("SELECT llm_generate('{MODEL}', prompt) IS NULL AS failed, count(*) AS n FROM t GROUP BY 1 ORDER BY 1");
    let batches = ctx.sql(&grouped).await.unwrap().collect().await.unwrap();
    let n = batches[0].column(1).as_primitive::<datafusion::arrow::datatypes::Int64Type>();
    assert_eq!((n.value(0), n.value(1)), (39, 1));
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_is_made_once_per_row_and_only_for_rows_that_pass_the_filters() {
    let (sim, _f, ctx) = setup(|_| {}, 0).await;
    ctx.register_table("t", Arc::new(table(20, 2, "once", &[]))).unwrap();
    let r = format!("llm_generate_result('{MODEL}', prompt)");
    let g = format!("llm_generate('{MODEL}', prompt)");
    // (query, rows it returns, calls it may make)
    let cases = [
        // Two fields of one struct: DataFusion's field push-down would make each a call.
        (format!("SELECT id, r['response'] AS a, r['model'] AS m FROM (SELECT id, {r} AS r FROM t)"), 20, 20),
        // ... and would move the call under the filter, calling for all 20 rows.
        (
            format!("SELECT id, r['response'] AS a, r['model'] AS m FROM (SELECT id, {r} AS r FROM t) WHERE id < 5"),
            5,
            5,
        ),
        (format!("SELECT id, {r}['response'] AS a, {r}['model'] AS m FROM t WHERE id < 5"), 5, 5),
        (format!("SELECT r['response'] AS a FROM (SELECT {r} AS r FROM t) WHERE r['error_kind'] IS NULL"), 20, 20),
        // The same call in a projection and its filter, or twice in one projection.
        (format!("SELECT id, {g} AS a FROM t WHERE {g} IS NOT NULL AND id >= 15"), 5, 5),
        (format!("SELECT id, length({g}) AS n, {g} AS a FROM t"), 20, 20),
        (
            format!(
                "SELECT x.id, r['response'] FROM (SELECT id, {r} AS r FROM t) x JOIN t ON x.id = t.id WHERE x.id < 3"
            ),
            3,
            3,
        ),
        // A call over another call's answer (DataFusion merges them into a nested call).
        (format!("SELECT llm_generate('{MODEL}', a) AS b FROM (SELECT {g} AS a FROM t WHERE id < 4)"), 4, 8),
        (format!("SELECT llm_generate('{MODEL}', llm_generate('{MODEL}', {g})) AS c FROM t WHERE id < 2"), 2, 6),
    ];
    for (sql, rows, calls) in cases {
        let before = sim.stats().requests;
        let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        let n: usize = batches.iter().map(|b| b.num_rows()).sum();
        let made = sim.stats().requests - before;
        assert_eq!((n, made), (rows, calls), "rows and calls of {sql}");
    }
    sim.shutdown().await;
}
