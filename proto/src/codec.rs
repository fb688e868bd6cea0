//! The codec of every gpuctl service: tonic's prost codec with a smaller
//! first buffer. tonic allocates the buffer of each call up front, 8 KiB by
//! default, and keeps it for as long as a stream lives: that was 8.7 KB of
//! each agent's bookkeeping at the leader, for WatchTasks streams whose
//! messages are mostly a few hundred bytes; an idle agent's stream sends a
//! few bytes. Bigger messages grow it (one more allocation for the call).
//!
//! A big message is decoded off the async worker (`block_in_place`): tokio
//! polls its timers and sockets only from idle workers, so one long decode
//! can stop a whole runtime. A 13 MiB SubmitJob (a million env variables)
//! took 2.7 s to decode in a debug build, and the leader, whose runtime read
//! no Raft message meanwhile, lost its term (issue 31).

use std::marker::PhantomData;

use prost::bytes::Buf as _;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

/// First buffer of a call, in bytes.
const BUFFER_SIZE: usize = 128;
/// tonic's default: a stream with messages ready batches up to this much.
const YIELD_THRESHOLD: usize = 32 * 1024;
/// Messages bigger than this are decoded off the async worker.
pub const OFFLOAD_BYTES: usize = 64 * 1024;

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
}

/// Named in the generated code through tonic-build's `codec_path`.
#[derive(Debug, Clone, Copy)]
pub struct GpuctlCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for GpuctlCodec<T, U> {
    fn default() -> Self {
        GpuctlCodec(PhantomData)
    }
}

impl<T, U> Codec for GpuctlCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = MessageEncoder<T>;
    type Decoder = MessageDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        MessageEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        MessageDecoder(PhantomData)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct MessageEncoder<T>(PhantomData<T>);

impl<T: prost::Message> Encoder for MessageEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // The buffer grows as needed, so this does not fail; if it did, the
        // call fails rather than the process.
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encoding a message: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}

#[derive(Debug, Clone, Copy)]
pub struct MessageDecoder<U>(PhantomData<U>);

impl<U: prost::Message + Default> Decoder for MessageDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // INTERNAL, as gRPC's status codes ask for a message that does not
        // parse (and as tonic's own codec answers).
        let decode = |buf: &mut DecodeBuf<'_>| {
            U::decode(buf)
                .map(Some)
                .map_err(|e| Status::internal(e.to_string()))
        };
        if buf.remaining() > OFFLOAD_BYTES && may_block_in_place() {
            tokio::task::block_in_place(|| decode(buf))
        } else {
            decode(buf)
        }
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}

/// Whether `block_in_place` may run here: on a multi-thread runtime it
/// hands the worker's other tasks to another thread; on a current-thread
/// runtime it would panic. Outside a runtime nothing waits on this thread.
fn may_block_in_place() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_core::pb;

    /// Messages far bigger than the first buffer go through whole (the
    /// buffer grows), through tonic's own framing; one is big enough to be
    /// decoded off the worker where the runtime allows it.
    async fn round_trip() {
        use tokio_stream::StreamExt as _;
        let big = pb::DesiredTasks {
            kill: (0..2_000).map(|i| format!("task-{i:06}")).collect(),
            ..Default::default()
        };
        let huge = pb::DesiredTasks {
            kill: (0..20_000).map(|i| format!("task-{i:06}")).collect(),
            ..Default::default()
        };
        let small = pb::DesiredTasks {
            reset: true,
            ..Default::default()
        };
        let sent = vec![small.clone(), big.clone(), small.clone(), huge.clone()];
        let mut codec = GpuctlCodec::<pb::DesiredTasks, pb::DesiredTasks>::default();
        let body = tonic::codec::EncodeBody::new_server(
            codec.encoder(),
            tokio_stream::iter(sent.clone().into_iter().map(Ok)),
            None,
            Default::default(),
            None,
        );
        let mut got = tonic::codec::Streaming::new_response(
            codec.decoder(),
            body,
            tonic::codegen::http::StatusCode::OK,
            None,
            None,
        );
        let mut received = Vec::new();
        while let Some(m) = got.next().await {
            received.push(m.expect("decodes"));
        }
        assert_eq!(received, sent);
        assert!(prost::Message::encoded_len(&big) > 20 * BUFFER_SIZE);
        assert!(prost::Message::encoded_len(&huge) > OFFLOAD_BYTES);
    }

    /// Where block_in_place would panic, big messages are decoded in place.
    #[tokio::test]
    async fn messages_round_trip_on_a_current_thread_runtime() {
        assert!(!may_block_in_place());
        round_trip().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn messages_round_trip_on_a_multi_thread_runtime() {
        assert!(may_block_in_place());
        round_trip().await;
    }
}
