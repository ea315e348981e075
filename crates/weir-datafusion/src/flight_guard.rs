//! An executor's Arrow Flight service that serves only its own shuffle files.
//!
//! Ballista's Flight service builds the file it reads from the job id in the ticket
//! (`WORK_DIR/JOB/STAGE/PARTITION/…`) without checking it, so a ticket whose job id holds `..` or
//! `/` reads outside the work directory. The scheduler makes job ids of letters and digits; this
//! wrapper refuses any other before Ballista's service sees the ticket, and passes everything
//! else through unchanged.

use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo, HandshakeRequest, PollInfo, SchemaResult, Ticket,
};
use ballista_executor::flight_service::BallistaFlightService;
use std::sync::Arc;
use tonic::{Request, Response, Status, Streaming};

/// Whether `job` is a job id as the scheduler makes them: letters, digits, `-` and `_` only.
fn plain_job_id(job: &str) -> bool {
    !job.is_empty() && job.len() <= 64 && job.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Refuses a Flight request whose encoded action names a job id that is not plain.
fn check(encoded: &[u8]) -> Result<(), Status> {
    use ballista_core::serde::scheduler::Action as BallistaAction;
    // What does not decode is left to Ballista's own refusal.
    if let Ok(BallistaAction::FetchPartition { job_id, .. }) = ballista_core::serde::decode_protobuf(encoded) {
        if !plain_job_id(job_id.as_str()) {
            return Err(Status::permission_denied("not a job id of this cluster"));
        }
    }
    Ok(())
}

/// Ballista's Flight service behind the job-id check.
pub struct GuardedFlight(BallistaFlightService);

type Answer<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl FlightService for GuardedFlight {
    type HandshakeStream = <BallistaFlightService as FlightService>::HandshakeStream;
    type ListFlightsStream = <BallistaFlightService as FlightService>::ListFlightsStream;
    type DoGetStream = <BallistaFlightService as FlightService>::DoGetStream;
    type DoPutStream = <BallistaFlightService as FlightService>::DoPutStream;
    type DoActionStream = <BallistaFlightService as FlightService>::DoActionStream;
    type ListActionsStream = <BallistaFlightService as FlightService>::ListActionsStream;
    type DoExchangeStream = <BallistaFlightService as FlightService>::DoExchangeStream;

    async fn do_get(&self, request: Request<Ticket>) -> Answer<Self::DoGetStream> {
        check(&request.get_ref().ticket)?;
        self.0.do_get(request).await
    }

    async fn do_action(&self, request: Request<Action>) -> Answer<Self::DoActionStream> {
        check(&request.get_ref().body)?;
        self.0.do_action(request).await
    }

    async fn handshake(&self, request: Request<Streaming<HandshakeRequest>>) -> Answer<Self::HandshakeStream> {
        self.0.handshake(request).await
    }

    async fn list_flights(&self, request: Request<Criteria>) -> Answer<Self::ListFlightsStream> {
        self.0.list_flights(request).await
    }

    async fn get_flight_info(&self, request: Request<FlightDescriptor>) -> Answer<FlightInfo> {
        self.0.get_flight_info(request).await
    }

    async fn poll_flight_info(&self, request: Request<FlightDescriptor>) -> Answer<PollInfo> {
        self.0.poll_flight_info(request).await
    }

    async fn get_schema(&self, request: Request<FlightDescriptor>) -> Answer<SchemaResult> {
        self.0.get_schema(request).await
    }

    async fn do_put(&self, request: Request<Streaming<FlightData>>) -> Answer<Self::DoPutStream> {
        self.0.do_put(request).await
    }

    async fn list_actions(&self, request: Request<Empty>) -> Answer<Self::ListActionsStream> {
        self.0.list_actions(request).await
    }

    async fn do_exchange(&self, request: Request<Streaming<FlightData>>) -> Answer<Self::DoExchangeStream> {
        self.0.do_exchange(request).await
    }
}

/// The executor's Flight server (see `ExecutorProcessConfig::override_arrow_flight_service`),
/// with Ballista's message size limits `max_message`.
pub fn provider(max_message: usize) -> Arc<ballista_executor::ArrowFlightServerProvider> {
    Arc::new(move |work_dir, address, mut shutdown: ballista_executor::shutdown::Shutdown, grpc| {
        tokio::spawn(async move {
            let service = FlightServiceServer::new(GuardedFlight(BallistaFlightService::new(work_dir)))
                .max_decoding_message_size(max_message)
                .max_encoding_message_size(max_message);
            ballista_core::utils::create_grpc_server(&grpc)
                .add_service(service)
                .serve_with_shutdown(address, shutdown.recv())
                .await
                .map_err(ballista_core::error::BallistaError::TonicError)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_job_ids_pass() {
        assert!(plain_job_id("aB3xY9z"));
        for bad in ["", "..", "../../etc", "a/b", "a\\b", "job id", "x\0"] {
            assert!(!plain_job_id(bad), "{bad:?}");
        }
    }

    /// A client asking an executor's Flight port for a partition of job `job`; the error.
    async fn fetch(port: u16, job: &str) -> String {
        use ballista_core::serde::scheduler::{PartitionId, ShuffleLayout};
        let mut client = ballista_core::client::BallistaClient::try_new(
            "127.0.0.1",
            port,
            1 << 24,
            false,
            None,
            1,
            0,
            1 << 20,
            1 << 20,
        )
        .await
        .unwrap();
        let id = PartitionId { job_id: job.into(), stage_id: 1, partition_id: 0 };
        let mut errors = Vec::new();
        for flight in [true, false] {
            match client.fetch_partition("e", &id, None, ShuffleLayout::Passthrough, flight).await {
                Ok(_) => errors.push("served".to_string()),
                Err(e) => errors.push(e.to_string()),
            }
        }
        errors.join(" | ")
    }

    #[tokio::test]
    async fn a_ticket_naming_a_path_out_of_the_work_directory_is_refused() {
        let base = std::env::temp_dir().join(format!("weir-flight-guard-{}", std::process::id()));
        let work = base.join("work");
        std::fs::create_dir_all(work.join("aB3xY9z/1/0")).unwrap();
        std::fs::create_dir_all(base.join("secret/1/0")).unwrap();
        std::fs::write(base.join("secret/1/0/data.arrow"), b"not for you").unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let notifier = ballista_executor::shutdown::ShutdownNotifier::new();
        let server = (provider(1 << 24))(
            work.display().to_string(),
            std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            notifier.subscribe_for_shutdown(),
            Default::default(),
        );
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let refused = fetch(port, "../secret").await;
        assert_eq!(refused.matches("not a job id of this cluster").count(), 2, "{refused}");
        // A job id the scheduler could have made passes the guard (and finds no file).
        let passed = fetch(port, "aB3xY9z").await;
        assert!(!passed.contains("not a job id"), "{passed}");
        server.abort();
        let _ = std::fs::remove_dir_all(&base);
    }
}
