# These feed providers/gcp.py:
#   GcpCompute(project=project, image=gpu_image, network=network,
#              subnetwork=subnetwork, service_account=service_account_email)
# and every instance the broker creates must carry network_tag.

output "project" {
  description = "GCP project id of the job nodes."
  value       = var.project
}

output "region" {
  description = "Region of the subnetwork; the broker may create nodes in any zone of it."
  value       = var.region
}

output "network" {
  description = "VPC network, as a relative resource name projects/P/global/networks/N (accepted by instances.insert)."
  value       = google_compute_network.this.id
}

output "subnetwork" {
  description = "Subnetwork, as projects/P/regions/R/subnetworks/S (accepted by instances.insert)."
  value       = google_compute_subnetwork.nodes.id
}

output "service_account_email" {
  description = "Service account the nodes run as."
  value       = google_service_account.node.email
}

output "instance_template" {
  description = "Instance template, as projects/P/global/instanceTemplates/T."
  value       = google_compute_instance_template.node.id
}

output "gpu_image" {
  description = "Boot image (or image family) of the nodes."
  value       = var.gpu_image
}

output "network_tag" {
  description = "Network tag every job node must carry: the NCCL firewall rule matches it."
  value       = local.network_tag
}
