//! Model calls moved into a projection of their own, where each is computed once per row:
//!
//! - calls inside an aggregate (`SELECT count(llm_generate(…)) FROM t`). DataFusion plans such
//!   a call as an async step under the aggregate but leaves the aggregate's recorded input
//!   schema without the call's column; on one machine nothing reads that schema, but a cluster
//!   ships plans as protobuf and the executors, decoding the aggregate against it, reject the
//!   task.
//! - a call that a projection names more than once. The user writes it once: `SELECT
//!   r['response'], r['error_kind'] FROM (SELECT llm_generate_result(…) AS r FROM t)`; but
//!   DataFusion moves struct field accesses down to where the struct is made, leaving
//!   `get_field(llm_generate_result(…), 'response'), get_field(llm_generate_result(…),
//!   'error_kind')`, and a volatile function is never merged with its copy: every field read
//!   would be a call of its own, paid for.
//! - a call over another call's answer (`SELECT llm_generate(m, a) FROM (SELECT
//!   llm_generate(m, p) AS a FROM t)`, merged by DataFusion into one nested call that its async
//!   step cannot run): the inner call is computed first, in a projection of its own.
//! - a call that a projection and the filter right under it both make (`SELECT llm_generate(m,
//!   p) FROM t WHERE llm_generate(m, p) IS NOT NULL`): one call per row, shared.
//!
//! With the calls computed in a projection first, the node above reads plain columns, and the
//! plan means the same.
//!
//! DataFusion's two rules that push struct field accesses towards the scan
//! ([`MOVES_CALLS`]) are left out of sessions with weir's functions: they merge
//! `get_field(r, …)` into the projection that makes `r` whatever `r` is, so the field reads
//! became calls of their own (one per field) and were moved below filters (`WHERE id < 3`
//! then called the model for every row of the table).

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::Result;
use datafusion::logical_expr::{col, Aggregate, Expr, Filter, LogicalPlan, Projection};
use datafusion::optimizer::{ApplyOrder, Optimizer, OptimizerConfig, OptimizerRule};
use std::sync::Arc;

/// DataFusion's optimizer rules that move a model call (copy it into each struct field read,
/// and under filters): the sessions with weir's functions run without them.
pub const MOVES_CALLS: [&str; 2] = ["extract_leaf_expressions", "push_down_leaf_projections"];

/// DataFusion's default optimizer rules without [`MOVES_CALLS`], and [`HoistModelCalls`] last:
/// the rules for a session built from parts (a cluster scheduler's).
pub fn optimizer_rules() -> Vec<Arc<dyn OptimizerRule + Send + Sync>> {
    let mut rules: Vec<_> = Optimizer::new().rules.into_iter().filter(|r| !MOVES_CALLS.contains(&r.name())).collect();
    rules.push(Arc::new(HoistModelCalls));
    rules
}

/// The optimizer rule; add it to every session that plans queries with weir's functions (the
/// client's, and a cluster scheduler's).
#[derive(Debug, Default)]
pub struct HoistModelCalls;

/// True for a call of an async scalar function (weir's functions are the async ones).
fn is_async_call(e: &Expr) -> bool {
    matches!(e, Expr::ScalarFunction(f) if f.func.as_async().is_some())
}

/// The distinct outermost async calls in `exprs`, each with how often it appears.
fn calls_in<'a>(exprs: impl IntoIterator<Item = &'a Expr>) -> Result<Vec<(Expr, usize)>> {
    let mut calls: Vec<(Expr, usize)> = Vec::new();
    for e in exprs {
        e.apply(|x| {
            if is_async_call(x) {
                match calls.iter_mut().find(|(c, _)| c == x) {
                    Some((_, n)) => *n += 1,
                    None => calls.push((x.clone(), 1)),
                }
                return Ok(TreeNodeRecursion::Jump);
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
    }
    Ok(calls)
}

/// The distinct outermost async calls inside the arguments of other async calls in `exprs`
/// (`llm_generate(m, llm_generate(m, p))`, which DataFusion makes of a call over a subquery's
/// call and cannot run: its async step computes every call from the input's columns).
fn nested_calls<'a>(exprs: impl IntoIterator<Item = &'a Expr>) -> Result<Vec<Expr>> {
    let mut inner: Vec<Expr> = Vec::new();
    for e in exprs {
        e.apply(|x| {
            if let Expr::ScalarFunction(f) = x {
                if f.func.as_async().is_some() {
                    for (c, _) in calls_in(&f.args)? {
                        if !inner.contains(&c) {
                            inner.push(c);
                        }
                    }
                    return Ok(TreeNodeRecursion::Jump);
                }
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
    }
    Ok(inner)
}

/// `calls` computed once each in a projection over `input` (which keeps every input column),
/// and a function that rewrites an expression to read their columns instead, keeping its
/// output name.
fn hoist(calls: Vec<Expr>, input: &Arc<LogicalPlan>) -> Result<(LogicalPlan, impl Fn(&Expr) -> Result<Expr>)> {
    let schema = input.schema();
    // Names free in the input (a lower projection of this rule's may have used some).
    let names: Vec<String> = (0..)
        .map(|i| format!("__weir_call_{i}"))
        .filter(|n| !schema.columns().iter().any(|c| &c.name == n))
        .take(calls.len())
        .collect();
    let mut exprs: Vec<Expr> = schema.columns().into_iter().map(Expr::Column).collect();
    exprs.extend(calls.iter().zip(&names).map(|(c, n)| c.clone().alias(n)));
    let projection = LogicalPlan::Projection(Projection::try_new(exprs, input.clone())?);
    let replace = move |e: &Expr| -> Result<Expr> {
        let name = e.schema_name().to_string();
        let new = e
            .clone()
            .transform_down(|x| match calls.iter().position(|c| c == &x) {
                Some(i) => Ok(Transformed::new(col(&names[i]), true, TreeNodeRecursion::Jump)),
                None => Ok(Transformed::no(x)),
            })?
            .data;
        new.alias_if_changed(name)
    };
    Ok((projection, replace))
}

impl OptimizerRule for HoistModelCalls {
    fn name(&self) -> &str {
        "weir_hoist_model_calls"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::BottomUp)
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(&self, plan: LogicalPlan, _config: &dyn OptimizerConfig) -> Result<Transformed<LogicalPlan>> {
        match plan {
            LogicalPlan::Aggregate(agg) => {
                let calls: Vec<Expr> =
                    calls_in(agg.group_expr.iter().chain(&agg.aggr_expr))?.into_iter().map(|(c, _)| c).collect();
                if calls.is_empty() {
                    return Ok(Transformed::no(LogicalPlan::Aggregate(agg)));
                }
                let (projection, replace) = hoist(calls, &agg.input)?;
                let group = agg.group_expr.iter().map(&replace).collect::<Result<Vec<_>>>()?;
                let aggr = agg.aggr_expr.iter().map(&replace).collect::<Result<Vec<_>>>()?;
                let rewritten = Aggregate::try_new(Arc::new(projection), group, aggr)?;
                Ok(Transformed::yes(LogicalPlan::Aggregate(rewritten)))
            }
            LogicalPlan::Projection(p) => {
                // A call over another call's answer: the inner one first, in a projection below.
                let nested = nested_calls(&p.expr)?;
                if !nested.is_empty() {
                    let (projection, replace) = hoist(nested, &p.input)?;
                    // The hoisted calls may hold calls of their own (three deep): the same again.
                    let projection = self.rewrite(projection, _config)?.data;
                    let exprs = p.expr.iter().map(&replace).collect::<Result<Vec<_>>>()?;
                    let rewritten = Projection::try_new(exprs, Arc::new(projection))?;
                    return Ok(Transformed::yes(LogicalPlan::Projection(rewritten)));
                }
                // A call also made by a filter right under the projection
                // (`SELECT llm_generate(…) … WHERE llm_generate(…) IS NOT NULL`) is computed once,
                // under the filter, for both.
                if let LogicalPlan::Filter(filter) = p.input.as_ref() {
                    let below = calls_in([&filter.predicate])?;
                    let shared: Vec<Expr> = calls_in(&p.expr)?
                        .into_iter()
                        .map(|(c, _)| c)
                        .filter(|c| below.iter().any(|(b, _)| b == c))
                        .collect();
                    if !shared.is_empty() {
                        let (projection, replace) = hoist(shared, &filter.input)?;
                        let predicate = replace(&filter.predicate)?.unalias();
                        let filter = Filter::try_new(predicate, Arc::new(projection))?;
                        let exprs = p.expr.iter().map(&replace).collect::<Result<Vec<_>>>()?;
                        let rewritten = Projection::try_new(exprs, Arc::new(LogicalPlan::Filter(filter)))?;
                        return Ok(Transformed::yes(LogicalPlan::Projection(rewritten)));
                    }
                }
                let repeated: Vec<Expr> =
                    calls_in(&p.expr)?.into_iter().filter(|(_, n)| *n > 1).map(|(c, _)| c).collect();
                if repeated.is_empty() {
                    return Ok(Transformed::no(LogicalPlan::Projection(p)));
                }
                let (projection, replace) = hoist(repeated, &p.input)?;
                let exprs = p.expr.iter().map(&replace).collect::<Result<Vec<_>>>()?;
                let rewritten = Projection::try_new(exprs, Arc::new(projection))?;
                Ok(Transformed::yes(LogicalPlan::Projection(rewritten)))
            }
            plan => Ok(Transformed::no(plan)),
        }
    }
}
