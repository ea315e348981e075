//! Model calls inside an aggregate (`SELECT count(llm_generate(…)) FROM t`) moved into a
//! projection under it.
//!
//! DataFusion plans such a call as an async step under the aggregate but leaves the aggregate's
//! recorded input schema without the call's column; on one machine nothing reads that schema,
//! but a cluster ships plans as protobuf and the executors, decoding the aggregate against it,
//! reject the task. With the calls computed in a projection first, the aggregate sees plain
//! columns everywhere, and the plan means the same.

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::Result;
use datafusion::logical_expr::{col, Aggregate, Expr, LogicalPlan, Projection};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};
use std::sync::Arc;

/// The optimizer rule; add it to every session that plans queries with weir's functions (the
/// client's, and a cluster scheduler's).
#[derive(Debug, Default)]
pub struct HoistModelCalls;

/// True for a call of an async scalar function (weir's functions are the async ones).
fn is_async_call(e: &Expr) -> bool {
    matches!(e, Expr::ScalarFunction(f) if f.func.as_async().is_some())
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
        let LogicalPlan::Aggregate(agg) = plan else { return Ok(Transformed::no(plan)) };
        let mut calls: Vec<Expr> = Vec::new();
        for e in agg.group_expr.iter().chain(&agg.aggr_expr) {
            e.apply(|x| {
                if is_async_call(x) {
                    if !calls.contains(x) {
                        calls.push(x.clone());
                    }
                    return Ok(TreeNodeRecursion::Jump);
                }
                Ok(TreeNodeRecursion::Continue)
            })?;
        }
        if calls.is_empty() {
            return Ok(Transformed::no(LogicalPlan::Aggregate(agg)));
        }
        let names: Vec<String> = (0..calls.len()).map(|i| format!("__weir_call_{i}")).collect();
        let mut exprs: Vec<Expr> = agg.input.schema().columns().into_iter().map(Expr::Column).collect();
        exprs.extend(calls.iter().zip(&names).map(|(c, n)| c.clone().alias(n)));
        let projection = LogicalPlan::Projection(Projection::try_new(exprs, agg.input.clone())?);
        // Each expression with its calls replaced by their columns, keeping its output name.
        let replace = |e: &Expr| -> Result<Expr> {
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
        let group = agg.group_expr.iter().map(replace).collect::<Result<Vec<_>>>()?;
        let aggr = agg.aggr_expr.iter().map(replace).collect::<Result<Vec<_>>>()?;
        let rewritten = Aggregate::try_new(Arc::new(projection), group, aggr)?;
        Ok(Transformed::yes(LogicalPlan::Aggregate(rewritten)))
    }
}
