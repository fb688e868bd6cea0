//! Bad input reaches a client as INVALID_ARGUMENT naming the field.

use gpuctl_core::types::JobSpec;
use gpuctl_proto::pb;

#[test]
fn a_conversion_error_is_invalid_argument_naming_the_field() {
    let err = JobSpec::try_from(pb::JobSpec::default()).expect_err("an empty spec is invalid");
    let field = err.field.clone();
    let status = gpuctl_proto::invalid_argument(err);
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains(&field), "{}", status.message());
}
